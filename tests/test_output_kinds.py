"""vLLM's offline and async API forms: ``RequestOutputKind`` (deltas folded while a consumer
lags), ``SamplingParams.from_optional``, ``TokensPrompt`` / ``TextPrompt``,
``get_tokenizer()``, and ``LoRARequest(base_model_name=...)``."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from sonar import LLM, EngineArgs, LoRARequest, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt
from sonar.engine.async_client import AsyncLLM
from sonar.outputs import RequestOutput

KV_BYTES = 1 << 24
PROMPT = [11, 12, 13, 14, 15]


def params(kind: RequestOutputKind | str, **extra) -> SamplingParams:
    return SamplingParams(n=2, seed=3, temperature=0.9, max_tokens=12, logprobs=2, prompt_logprobs=1, output_kind=kind, **extra)


async def run(client: AsyncLLM, request_id: str, sampling: SamplingParams, lag_s: float = 0.0) -> list[RequestOutput]:
    outputs = []
    async for output in client.generate(request_id, {"prompt_token_ids": PROMPT}, sampling):
        outputs.append(output)
        await asyncio.sleep(lag_s)  # a slow consumer: deltas put meanwhile are folded into one
    return outputs


def folded(outputs: list[RequestOutput]) -> RequestOutput:
    total = outputs[0]
    for later in outputs[1:]:
        total.add(later)
    return total


@pytest.mark.parametrize("lag_s", [0.0, 0.02])
def test_deltas_add_up_to_the_cumulative_output(tiny_model_dir, lag_s: float) -> None:
    client = AsyncLLM.from_engine_args(EngineArgs(str(tiny_model_dir("llama")), dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_BYTES))

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        cumulative = await run(client, "c", params(RequestOutputKind.CUMULATIVE))
        deltas = await run(client, "d", params(RequestOutputKind.DELTA), lag_s)
        return cumulative, deltas

    try:
        cumulative, deltas = asyncio.run(main())
    finally:
        client.shutdown()
    final = cumulative[-1]
    assert final.finished and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    # each delta holds only what is new: no token is carried twice
    assert sum(len(c.token_ids) for d in deltas for c in d.outputs) == sum(len(c.token_ids) for c in final.outputs) == 24
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1
    if lag_s == 0.0:
        assert len(deltas) > 2
    total = folded(deltas)
    assert [c.index for c in total.outputs] == [0, 1]
    for got, want in zip(total.outputs, final.outputs):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert [list(entry) for entry in got.logprobs] == [list(entry) for entry in want.logprobs]
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
    assert [None if e is None else list(e) for e in total.prompt_logprobs] == [None if e is None else list(e) for e in final.prompt_logprobs]


def test_output_kinds_by_enum_or_name_and_from_optional() -> None:
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"
    assert SamplingParams(output_kind="delta").output_kind == "delta"
    with pytest.raises(ValueError, match="output_kind must be 'cumulative', 'delta' or 'final_only'"):
        SamplingParams(output_kind="partial")
    built = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, stop="x")
    assert (built.temperature, built.top_p, built.max_tokens, built.stop) == (1.0, 0.5, 16, ["x"])


def test_prompt_forms_tokenizer_and_lora_request_fields(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=KV_BYTES)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=PROMPT), greedy)[0]
    tokenizer = llm.llm_engine.get_tokenizer()
    assert tokenizer is llm.get_tokenizer()
    text = tokenizer.decode(PROMPT)
    by_text = llm.generate(TextPrompt(prompt=text), greedy)[0]
    assert by_ids.prompt_token_ids == PROMPT
    assert by_text.outputs[0].token_ids == llm.generate(text, greedy)[0].outputs[0].token_ids
    lora = LoRARequest("adapter", 1, "/adapters/a", base_model_name="base")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lora), type=LoRARequest) == lora
    assert LoRARequest("adapter", 1, "/adapters/a").base_model_name is None


def test_request_outputs_carry_their_timings(tiny_model_dir) -> None:
    import time

    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=KV_BYTES)
    before = time.time()
    output = llm.generate(TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    after = time.time()
    metrics = output.metrics
    assert before <= metrics["arrival_time"] <= metrics["first_token_time"] <= metrics["last_token_time"] <= after
    assert metrics["first_token_latency"] == pytest.approx(metrics["first_token_time"] - metrics["arrival_time"])
