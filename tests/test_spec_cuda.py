"""Speculative decoding on the CUDA platform (marker ``cuda``): verify steps replay the decode
graphs (one row per token), and greedy output stays token for token."""

from __future__ import annotations

import pytest

from sonar import SamplingParams
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _generate(path: str, prompts: list[list[int]], params: SamplingParams, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    from sonar_cuda.platform import CudaPlatform

    engine = LLMEngine(EngineArgs(model=path, dtype="float32", kv_cache_memory_bytes=64 << 20, **kwargs), platform=CudaPlatform)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_greedy_with_ngram_equals_without(tiny_model_dir, arch: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    path = str(tiny_model_dir(arch))
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(24)] * 2 for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected, _ = _generate(path, prompts, params)
    got, engine = _generate(path, prompts, params, speculative_config=NGRAM)
    assert got == expected
    assert engine.get_stats().spec_num_accepted_tokens > 0
    assert engine.core.executor.worker.model_runner.graphs.graphs, "decode graphs were still captured"


@pytest.mark.cuda
def test_cuda_greedy_with_several_verify_passes_a_step_equals_without(tiny_model_dir) -> None:
    """``verify_passes``: each request alone runs up to three verify passes a step through the
    decode graphs; the same tokens as without speculation, in fewer engine steps."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    path = str(tiny_model_dir("llama"))
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(24)] * 2 for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for prompt in prompts:
        expected, plain = _generate(path, [prompt], params)
        got, engine = _generate(path, [prompt], params, speculative_config={**NGRAM, "verify_passes": 3})
        assert got == expected
        assert engine.core.num_steps_launched < plain.core.num_steps_launched
