"""What the parallel tests compare: a model's greedy tokens and top logprobs at TP=2 or PP=2
(two real worker processes over gloo) against the same engine options on one device."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import pytest

from sonar import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13], [5, 900, 17, 3, 44, 8, 2, 19, 6, 33, 71, 402, 9, 77, 1203, 64, 18]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=128, max_num_seqs=8)


def generate(llm: LLM, requests: list[dict[str, Any]] | None = None, **kwargs: Any) -> list:
    requests = requests or [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(requests, PARAMS, **kwargs)


def two_ranks_and_one_device(model: str, **options: Any) -> tuple[list, list]:
    """``(one device's outputs, TP=2's outputs)`` for the same prompts and options."""
    return parallel_and_one_device(model, {"tensor_parallel_size": 2}, **options)


def parallel_and_one_device(model: str, parallel: dict[str, Any], **options: Any) -> tuple[list, list]:
    """``(one device's outputs, the outputs with the ``parallel`` sizes)`` for the same prompts
    and options."""
    single = LLM(model, **{**ENGINE, **options})
    expected = generate(single)
    del single
    parallel = LLM(model, **parallel, **{**ENGINE, **options})
    try:
        return expected, generate(parallel)
    finally:
        parallel.llm_engine.core.executor.shutdown()


def assert_same_greedy_run(expected: list, got: list, logprob_atol: float, near_tie: float | None = None) -> None:
    """Token for token the same greedy continuations, each step's top logprobs within
    ``logprob_atol``. With ``near_tie``, a run may part from one device's at a step where that
    run's top two tokens are within ``near_tie`` nats (the rounding of a kernel decides it);
    the rest of that continuation is then not compared."""
    for one, two in zip(expected, got, strict=True):
        steps = zip(one.outputs[0].token_ids, two.outputs[0].token_ids, one.outputs[0].logprobs, two.outputs[0].logprobs)
        for step, (token_a, token_b, a, b) in enumerate(steps):
            for token_id, logprob in a.items():
                if token_id in b:
                    assert abs(b[token_id].logprob - logprob.logprob) <= logprob_atol, (step, token_id)
            if token_a != token_b:
                top_two = sorted((lp.logprob for lp in a.values()), reverse=True)[:2]
                assert near_tie is not None and top_two[0] - top_two[1] < near_tie, (step, token_a, token_b, top_two)
                break
        assert len(two.outputs[0].token_ids) == len(one.outputs[0].token_ids)


def assert_a_killed_rank_fails_the_engine(llm: LLM, generate: Callable[[LLM], Any], rank: int = 1) -> None:
    """Kill rank ``rank`` of ``llm``'s executor: the next request fails at once with
    ``WorkerDiedError`` naming it, the engine stays failed, and no rank is left running."""
    from sonar.executor import WorkerDiedError

    executor = llm.llm_engine.core.executor
    os.kill(executor.worker_pids[rank], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"worker rank {rank} died"):
        generate(llm)
    assert time.monotonic() - started < 15
    with pytest.raises(WorkerDiedError):  # and stays failed
        generate(llm)
    for pid in executor.worker_pids:  # no rank is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
