"""The real SmolLM2-135M-Instruct GGUF: chat works, and greedy output equals transformers'."""

from __future__ import annotations

import pytest

from conftest import HFOracle
from sonar import LLM, SamplingParams

NEAR_TIE = 0.1  # nats between transformers' top two tokens, where the quantized kernels may pick either
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "1, 2, 3, 4, 5,",
]


def assert_greedy_equals_transformers(llm: LLM, gguf) -> None:
    """Greedy tokens of ``PROMPTS`` (24 each) equal transformers' on the same file, up to the
    first step where transformers' top two tokens are a near tie."""
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle(gguf.parent, gguf_file=gguf.name)
    for output, (expected, rows) in zip(outputs, oracle.greedy_many(prompts, 24)):
        got = output.outputs[0].token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if diverged is not None:  # natively quantized: only where the oracle's top two are a near tie
            top2 = rows[diverged].topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (diverged, got, expected)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(dtype="float32", max_model_len=1024)


def test_chat_answers_paris(smollm2: LLM) -> None:
    output = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"


def test_greedy_equals_transformers_on_the_same_gguf(smollm2: LLM) -> None:
    from sonar_models.testing import smollm2_gguf_path

    assert_greedy_equals_transformers(smollm2, smollm2_gguf_path())


def first_token_logprobs(llm: LLM, messages: list[dict]) -> dict[int, float]:
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    return {token: entry.logprob for token, entry in output.logprobs[0].items()}


def test_the_first_token_does_not_depend_on_how_the_prompt_is_cut(smollm2: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's last chunk runs the exact products however few rows it has: the chat prompt's
    first token (a 0.08-nat tie between "The" and "L" on this model) has the same logprobs
    whole, after a prefix-cache hit (5 of 37 tokens computed) and in 16-token chunks, in torch
    and (where it builds) with Sonar's C kernel."""
    from sonar_cpu import gguf_kernel

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = first_token_logprobs(smollm2, messages)
    cached = first_token_logprobs(smollm2, messages)  # the first 32 tokens from the prefix cache
    chunked = [first_token_logprobs(LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=16, enable_prefix_caching=False), messages)]
    if gguf_kernel.load() is not None:  # the C kernel is the default where it builds: torch's products too
        monkeypatch.setenv(gguf_kernel.SWITCH_ENV, "0")
        chunked.append(first_token_logprobs(LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=16, enable_prefix_caching=False), messages))
    tokenizer = smollm2.get_tokenizer()
    assert tokenizer.decode([max(whole, key=whole.get)]) == "The"
    for other in (cached, *chunked):
        assert other.keys() == whole.keys()
        for token, logprob in whole.items():
            assert other[token] == pytest.approx(logprob, abs=1e-3)


@pytest.fixture(scope="module")
def smollm2_q4_k_m(tmp_path_factory: pytest.TempPathFactory):
    """The embedded model's weights written again in llama.cpp's Q4_K_M recipe: its 576-wide
    inputs take no super-block of 256, so most tensors fall back to Q5_0, as llama.cpp writes
    them; the 1,536-wide down projections are Q4_K, or Q6_K on the layers given more bits."""
    from sonar_models.testing import rewrite_gguf, smollm2_gguf_path

    return rewrite_gguf(smollm2_gguf_path(), tmp_path_factory.mktemp("smollm2-q4_k_m"), "Q4_K_M")


def test_a_q4_k_m_file_of_real_weights_generates_what_transformers_does(smollm2_q4_k_m) -> None:
    from sonar_models.formats.gguf_blocks import Q4_K, Q5_0, Q6_K
    from sonar_models.formats.gguf_metadata import open_gguf

    kinds = {int(t.tensor_type) for t in open_gguf(smollm2_q4_k_m).tensors}
    assert {Q5_0, Q4_K, Q6_K} <= kinds
    assert_greedy_equals_transformers(LLM(str(smollm2_q4_k_m), dtype="float32", max_model_len=1024), smollm2_q4_k_m)
