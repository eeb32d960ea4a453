"""The offline ``LLM`` takes a vLLM user's arguments: those whose effect Sonar has anyway are
accepted (others of the same name refused with the values that would be accepted),
``enforce_eager`` reaches the engine, and ``max_logprobs`` above 20 allows that many."""

from __future__ import annotations

import pytest

from sonar import LLM, SamplingParams

KV_BYTES = 1 << 24


def test_vllm_arguments_that_change_nothing_are_accepted(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, swap_space=4, disable_log_stats=True,
              enable_chunked_prefill=True, tokenizer_mode="auto", cpu_offload_gb=0, compilation_config=3, max_seq_len_to_capture=8192)  # fmt: skip
    assert llm.llm_engine.config.enforce_eager
    for name, value in (("tokenizer_mode", "slow"), ("cpu_offload_gb", 4), ("enable_chunked_prefill", False)):
        with pytest.raises(ValueError, match=f"{name}="):
            LLM(path, **{name: value})


def test_max_logprobs_above_20_allows_that_many(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=KV_BYTES, max_logprobs=30)
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, logprobs=25, temperature=0))[0].outputs[0]
    assert all(len(entry) >= 25 for entry in output.logprobs)
    with pytest.raises(ValueError, match="exceeds max_logprobs=30"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, logprobs=31))
