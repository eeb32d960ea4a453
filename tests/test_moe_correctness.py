"""Mixture-of-experts models through the whole engine: greedy tokens and logprobs equal
transformers' on the tiny random Qwen3-MoE, Qwen2-MoE and Mixtral (float32, CPU)."""

from __future__ import annotations

import pytest

from conftest import HFOracle, random_prompts
from sonar import LLM, SamplingParams
from sonar_models.testing import MOE_ARCHS

NUM_PROMPTS = 4
NUM_TOKENS = 12


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_and_logprobs_match_transformers(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    prompts = random_prompts(NUM_PROMPTS, seed=40 + MOE_ARCHS.index(arch), max_len=60)
    # 32 tokens a step: prefills are chunked and batched beside other sequences' decodes
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        expected, rows = oracle.greedy(prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected
        for step, (entry, row) in enumerate(zip(completion.logprobs, rows)):
            top = row.topk(5)
            assert set(top.indices.tolist()) <= set(entry), f"step {step}: top-5 ids differ"
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) < 1e-3
