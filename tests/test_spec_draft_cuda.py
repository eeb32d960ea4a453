"""The draft-model proposer on the CUDA platform (marker ``cuda``): the drafter runs eagerly
beside the target's captured decode graphs, greedy output stays token for token, and the
drafter's weights and KV cache are counted before the target's KV cache is sized."""

from __future__ import annotations

import pytest
import torch
from sonar import SamplingParams
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine

K = 3
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _engine(path: str, **kwargs) -> LLMEngine:
    from sonar_cuda.platform import CudaPlatform

    return LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=512, **kwargs), platform=CudaPlatform)


def _generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def small_drafter(tmp_path_factory) -> str:
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("drafter") / "llama-small"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    return str(build_tiny_model("llama", folder, **shape))  # head_dim 16: the smallest the GPU kernels take


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_greedy_with_a_draft_model_equals_without(tiny_model_dir, small_drafter, arch: str) -> None:
    path = str(tiny_model_dir(arch))
    prompts = [[(i * 31 + j * 7) % 500 + 100 for j in range(20 + i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts]
    params[5] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2)  # no drafts
    expected = _generate(_engine(path, kv_cache_memory_bytes=64 << 20), prompts, params)
    drafters = [path] + ([small_drafter] if arch == "llama" else [])
    for drafter in drafters:
        config = {"method": "draft_model", "model": drafter, "num_speculative_tokens": K}
        engine = _engine(path, kv_cache_memory_bytes=64 << 20, speculative_config=config)
        assert _generate(engine, prompts, params) == expected
        stats = engine.get_stats()
        assert stats.spec_num_drafts > 0
        if drafter == path:  # the target drafting for itself: every draft agrees
            assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens
        assert engine.core.executor.worker.model_runner.graphs.graphs, "decode graphs were still captured"


def test_cuda_sampled_drafts_of_the_target_itself_are_accepted_through_their_probabilities(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    engine = _engine(path, kv_cache_memory_bytes=64 << 20, speculative_config=config)
    prompts = [[(i * 31 + j * 7) % 500 + 100 for j in range(20)] for i in range(6)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]
    first = _generate(engine, prompts, params)
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
    assert _generate(engine, prompts, params) == first


def test_cuda_the_drafters_cache_is_allocated_at_load_and_reported(tiny_model_dir) -> None:
    """Allocated while the models load, the drafter's cache is memory in use when the worker
    measures the budget of the target's cache (after loading, before allocating it)."""
    path = str(tiny_model_dir("llama"))
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    engine = _engine(path, gpu_memory_utilization=0.3, speculative_config=config)
    worker = engine.core.executor.worker
    draft_kv = worker.model_runner.spec.proposer.kv
    # 32 sequences (disable_by_batch_size) of 512 + K tokens, 2 layers of keys and values, 2 x 16 floats each
    assert draft_kv.num_bytes == 32 * 33 * 16 * 2 * 2 * 2 * 16 * 4
    assert worker.profile_report()["draft_kv_cache_bytes"] == draft_kv.num_bytes
    assert all(cache.is_cuda for cache in draft_kv.kv_caches)
