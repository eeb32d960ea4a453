"""Asynchronous scheduling: the next step is launched before the last one's results are read,
and nothing a request sees changes."""

from __future__ import annotations

import pytest

from conftest import random_prompts
from sonar import LLM, SamplingParams


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def _llm(path, async_scheduling: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    return LLM(str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=64, async_scheduling=async_scheduling, **kwargs)


def _mixed_workload() -> tuple[list[dict], list[SamplingParams]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(14, seed=21, min_len=5, max_len=100)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=10),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=18, seed=3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=33, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, no_repeat_ngram_size=2),
        SamplingParams(temperature=0.7, max_tokens=27, seed=11, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=35, dry_multiplier=0.8),
        SamplingParams(temperature=0.0, max_tokens=16, n=2),
        SamplingParams(temperature=0.9, max_tokens=22, seed=5, n=3),
        SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),
    ]
    return prompts, params


def _assert_same_outputs(got, expected) -> None:
    """Same tokens and finish reasons; logprobs equal up to float noise (the batches differ:
    an asynchronous step may carry a request that turns out to have finished)."""
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
        assert [c.finish_reason for c in ours.outputs] == [c.finish_reason for c in theirs.outputs]
        pairs = [(a.logprobs, b.logprobs) for a, b in zip(ours.outputs, theirs.outputs)]
        pairs.append((ours.prompt_logprobs, theirs.prompt_logprobs))
        for a, b in pairs:
            assert (a is None) == (b is None)
            for step_a, step_b in zip(a or [], b or [], strict=True):
                assert (step_a is None) == (step_b is None)
                if step_a is None:
                    continue
                assert step_a.keys() == step_b.keys()
                for token_id in step_a:
                    assert step_a[token_id].logprob == pytest.approx(step_b[token_id].logprob, abs=1e-4)


@pytest.mark.parametrize("with_readers", [False, True], ids=["plain", "with-penalties"])
def test_async_outputs_equal_synchronous_ones(llama_dir, with_readers: bool) -> None:
    prompts, params = _mixed_workload()
    if not with_readers:  # every step overlaps
        params = [p.clone(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, no_repeat_ngram_size=0, dry_multiplier=0.0) for p in params]
        assert not any(p.reads_output_tokens for p in params)
    expected = _llm(llama_dir, False).generate(prompts, params)
    engine = _llm(llama_dir, True)
    in_flight = _record_calls(engine.llm_engine)
    got = engine.generate(prompts, params)
    assert in_flight.count(2) > (30 if not with_readers else 0)
    _assert_same_outputs(got, expected)
    assert any(o.outputs[0].logprobs for o in got) and any(o.prompt_logprobs for o in got)
    stats = engine.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_async_with_preemption_and_stop_tokens(llama_dir) -> None:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(10, seed=5, min_len=30, max_len=90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in _llm(llama_dir, False).generate(prompts, greedy)]
    # each request stops at a token it produces mid-way: the step launched after it is wasted
    params = [greedy.clone(stop_token_ids=[ids[7 + i]], ignore_eos=False) for i, ids in enumerate(reference)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k/v, layers, block, kv heads, head_dim, fp32
    tight = dict(kv_cache_memory_bytes=16 * block_bytes)  # one or two sequences at a time
    expected = _llm(llama_dir, False, **tight).generate(prompts, params)
    engine = _llm(llama_dir, True, **tight)
    got = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    stats = engine.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def _record_calls(engine) -> list[int]:
    """Per fetch, how many launched steps had not been fetched yet (2: the next step was
    launched before this one's results were read)."""
    executor = engine.core.executor
    real_launch, real_fetch = executor.launch, executor.fetch
    unfetched: list = []
    in_flight_at_fetch: list[int] = []

    def launch(scheduled):
        handle = real_launch(scheduled)
        unfetched.append(handle)
        return handle

    def fetch(handle):
        in_flight_at_fetch.append(len(unfetched))
        unfetched.remove(handle)
        return real_fetch(handle)

    executor.launch, executor.fetch = launch, fetch
    return in_flight_at_fetch


def test_the_next_step_is_launched_before_the_last_is_read(llama_dir) -> None:
    llm = _llm(llama_dir, True)
    in_flight = _record_calls(llm.llm_engine)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=2, min_len=10, max_len=20)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert max(in_flight) == 2  # never more than one step ahead
    assert in_flight.count(2) >= 10


def test_requests_that_read_their_tokens_are_not_overlapped(llama_dir) -> None:
    llm = _llm(llama_dir, True)
    in_flight = _record_calls(llm.llm_engine)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=2, min_len=10, max_len=20)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2, ignore_eos=True))
    assert in_flight and set(in_flight) == {1}


def test_abort_while_a_step_is_in_flight(llama_dir) -> None:
    llm = _llm(llama_dir, True)
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(4, seed=9, min_len=20, max_len=40)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.core._in_flight is not None
    engine.abort_request(["r1", "r2"])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id in ("r0", "r3")
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["r0", "r3"] and all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    engine.step()  # collects whatever is left in flight
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_grammar_requests_among_overlapped_ones(llama_dir) -> None:
    """A constrained request joins a batch whose previous step is still in flight: its mask
    and matcher see every token, and the plain requests beside it are unchanged."""
    import json

    from sonar.structured_output import GuidedDecodingParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema))
    prompts = ["Plain one", "Plain two", "Record:", "Plain three", "Another record:"]
    params = [plain, plain, constrained, plain, constrained.clone(temperature=0.8, seed=3)]
    expected = _llm(llama_dir, False).generate(prompts, params)
    engine = _llm(llama_dir, True)
    in_flight = _record_calls(engine.llm_engine)
    got = engine.generate(prompts, params)
    assert in_flight.count(2) > 0  # plain steps did overlap
    _assert_same_outputs(got, expected)
    for index in (2, 4):
        completion = got[index].outputs[0]
        assert completion.finish_reason == "stop"
        value = json.loads(completion.text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99


def test_the_default_follows_the_platform(llama_dir) -> None:
    from sonar_cuda.platform import CudaPlatform
    from sonar_cpu.platform import CpuPlatform

    # on the CPU the host computes each step itself: overlapping would only delay outputs
    assert CpuPlatform.async_scheduling is False and CudaPlatform.async_scheduling is True
    assert LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20).llm_engine.core.async_scheduling is False
    assert _llm(llama_dir, True).llm_engine.core.async_scheduling is True
