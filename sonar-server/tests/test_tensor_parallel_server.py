"""``sonar serve -tp 2`` on the CPU: two worker ranks under the engine core serve the tokens
one device gives, and a rank that dies takes the server to its dead-engine state."""

from __future__ import annotations

import os
import signal
import time

import httpx

from conftest import KV_CACHE_BYTES, ServerProcess
from test_multiprocess import alive, by_title

PROMPTS = ["The quick brown fox", "Once upon a time"]


def test_serve_with_two_ranks_then_lose_one(tmp_path) -> None:
    from sonar import LLM, SamplingParams
    from sonar_models.testing import build_tiny_model

    model = str(build_tiny_model("mistral", tmp_path / "mistral"))
    single = LLM(model, kv_cache_memory_bytes=int(KV_CACHE_BYTES), max_model_len=512)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))]
    server = ServerProcess([model, "--served-model-name", "tiny", "-tp", "2", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512"])
    try:
        for prompt, text in zip(PROMPTS, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        ranks = by_title(server.process.pid, "sonar::tp-worker-")
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        started = time.monotonic()
        failed = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert failed.status_code == 503, failed.text
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the server noticed the dead engine"
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "dead"
    finally:
        server.stop()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in ranks):  # no rank is left behind
        assert time.monotonic() < deadline, "the other rank exited"
        time.sleep(0.1)
