"""``sonar serve -dp 2 -tp 2`` on the CPU: two engine-core replicas, each with its own mp
executor and two worker ranks over gloo, answer requests with the greedy text of one device;
the host's cores are shared out over the four ranks."""

from __future__ import annotations

import concurrent.futures
import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess
from test_multiprocess import by_title

PROMPTS = ["The quick brown fox", "Once upon a time"]


def test_two_replicas_of_two_ranks_answer_like_one_device(tmp_path, monkeypatch) -> None:
    from sonar import LLM, SamplingParams
    from sonar_cpu.platform import CpuPlatform, num_usable_cores
    from sonar_models.testing import build_tiny_model

    monkeypatch.delenv("SONAR_CPU_THREADS", raising=False)
    share = str(max(1, num_usable_cores() // 4))  # each replica's two ranks keep the replica's slice
    assert [CpuPlatform.replica_env(i, 2, 2) for i in range(2)] == [{"SONAR_CPU_THREADS": share}] * 2
    model = str(build_tiny_model("llama", tmp_path / "llama"))
    single = LLM(model, kv_cache_memory_bytes=int(KV_CACHE_BYTES), max_model_len=512)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))]
    del single
    args = [model, "--served-model-name", "tiny", "-dp", "2", "-tp", "2", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512"]
    server = ServerProcess(args)
    try:
        ranks = by_title(server.process.pid, "sonar::tp-worker-")
        assert len(ranks) == 4  # two per replica

        def complete(prompt: str) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # at once: the replicas share them out
            assert list(pool.map(complete, PROMPTS)) == expected
    finally:
        server.stop()


def test_replicas_of_pipeline_stages_are_refused(tmp_path) -> None:
    from sonar import LLM

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 does not combine with data_parallel_size > 1 yet"):
        LLM(str(tmp_path), data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
