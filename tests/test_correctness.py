"""Greedy outputs and logprobs equal transformers' on tiny random models of each architecture."""

from __future__ import annotations

import pytest

from conftest import ARCHS, HFOracle, random_prompts
from sonar import LLM, SamplingParams

NUM_PROMPTS = 16
NUM_TOKENS = 32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [None, 48])  # 48: prefill chunks mixed with decodes
def test_greedy_and_logprobs_match_transformers(tiny_model_dir, arch: str, budget: int | None) -> None:
    path = tiny_model_dir(arch)
    prompts = random_prompts(NUM_PROMPTS, seed=ARCHS.index(arch))
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=budget, max_model_len=512, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        expected, rows = oracle.greedy(prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
        for step, (entry, row) in enumerate(zip(completion.logprobs, rows)):
            top = row.topk(5)
            assert set(top.indices.tolist()) <= set(entry), f"step {step}: top-5 ids differ"
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) < 1e-3
            chosen = expected[step]
            assert entry[chosen].rank == 1
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block returned


def test_prompt_logprobs_match_transformers(tiny_model_dir) -> None:
    import torch

    path = tiny_model_dir("qwen3")
    prompt = random_prompts(1, seed=7, min_len=40, max_len=40)[0]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    oracle = HFOracle(path)
    with torch.inference_mode():
        logits = oracle.model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        target = prompt[position]
        assert abs(entry[target].logprob - float(expected[position - 1, target])) < 1e-3
        assert len(entry) >= 3


def test_mistral_sliding_window_matches_transformers(tmp_path) -> None:
    from sonar_models.testing import build_tiny_model

    path = build_tiny_model("mistral", tmp_path / "mistral-window", sliding_window=12)
    prompts = random_prompts(4, seed=31, min_len=20, max_len=60)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == oracle.greedy(prompt, 16)[0]
