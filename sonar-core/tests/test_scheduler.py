"""The scheduler: token budget, sequence cap, chunked prefill with decodes, preemption."""

from __future__ import annotations

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request, RequestStatus
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.sampling_params import SamplingParams


def _scheduler(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, 256), KVCacheManager(num_blocks, block_size))


def _add(scheduler: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 8) -> Request:
    offset = 1000 * (len(scheduler.requests) + 1)  # distinct prompts: no prefix-cache sharing
    request = Request(request_id, list(range(offset, offset + num_prompt)), SamplingParams(max_tokens=max_tokens), [0], max_tokens)
    scheduler.add_request(request)
    return request


def _step(scheduler: Scheduler, token: int = 7) -> dict[str, int]:
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    tokens = []
    for req_id in ids:
        request = scheduler.requests[req_id]
        tokens.append(token if request.num_pending_tokens else None)  # it samples: a token is on the way
    scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))
    return dict(out.num_scheduled_tokens)


def test_budget_chunks_long_prompts_and_mixes_decodes() -> None:
    scheduler = _scheduler(budget=16)
    _add(scheduler, "short", 4)
    _add(scheduler, "long", 40)
    assert _step(scheduler) == {"short": 4, "long": 12}
    assert _step(scheduler) == {"short": 1, "long": 15}  # decode + next chunk in one step
    assert _step(scheduler) == {"short": 1, "long": 13}
    assert _step(scheduler) == {"short": 1, "long": 1}


def test_sequence_cap() -> None:
    scheduler = _scheduler(max_seqs=2)
    for i in range(3):
        _add(scheduler, f"r{i}", 3)
    assert set(_step(scheduler)) == {"r0", "r1"}
    assert len(scheduler.waiting) == 1


def test_preemption_frees_blocks_and_everything_finishes() -> None:
    scheduler = _scheduler(num_blocks=6, budget=64)
    requests = [_add(scheduler, f"r{i}", 6, max_tokens=10) for i in range(3)]
    preempted = False
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        _step(scheduler)
        preempted |= scheduler.num_preemptions > 0
        kv = scheduler.kv_cache
        # every block in use is held by a running request, which holds exactly what its
        # computed tokens need: nothing leaks, nothing is held twice
        assert 6 - kv.num_free_blocks == sum(kv.num_held_blocks(r.request_id) for r in scheduler.running)
        for r in scheduler.running:
            assert kv.num_held_blocks(r.request_id) == kv.num_blocks_for(r.num_computed_tokens)
        assert all(kv.num_held_blocks(r.request_id) == 0 for r in scheduler.waiting)
    assert preempted
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 10 for r in requests)
    assert scheduler.kv_cache.num_free_blocks == 6


def test_abort_frees_at_once() -> None:
    scheduler = _scheduler()
    request = _add(scheduler, "a", 10)
    _step(scheduler)
    assert scheduler.kv_cache.num_free_blocks < 64
    scheduler.abort_requests(["a"])
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == 64
    assert "a" in scheduler.schedule().finished_req_ids


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 40, 256, enable_chunked_prefill=False), KVCacheManager(64, 4))
    _add(scheduler, "a", 30)
    _add(scheduler, "b", 20)  # 30 + 20 > 40: b waits, and so does c behind it (no starving b)
    _add(scheduler, "c", 5)
    assert _step(scheduler) == {"a": 30}
    assert _step(scheduler) == {"a": 1, "b": 20, "c": 5}
    long = _add(scheduler, "long", 40)  # the whole budget: only once the others are done
    steps = [_step(scheduler) for _ in range(8)]
    first = next(i for i, step in enumerate(steps) if "long" in step)
    assert steps[first]["long"] == 40 and len(steps[first]) == 1
    assert long.num_computed_tokens >= 40
