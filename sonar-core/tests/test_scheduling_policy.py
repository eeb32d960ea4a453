"""Scheduling policies: FCFS by default, priority ordering of the waiting queue and of
preemption victims."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.engine.scheduling_policy import FcfsPolicy, PriorityPolicy, PriorityQueue
from sonar.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llama() -> Iterator[str]:
    from sonar_models.testing import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="sonar-priority-"))
    build_tiny_model("llama", folder)
    yield str(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _scheduler(policy, num_blocks: int = 64, max_seqs: int = 1, budget: int = 64, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, 256), KVCacheManager(num_blocks, block_size), policy)


def _request(request_id: str, num_prompt: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    offset = 1000 * (sum(map(ord, request_id)) % 97 + 1)
    return Request(request_id, list(range(offset, offset + num_prompt)), SamplingParams(max_tokens=max_tokens), [0], max_tokens,
                   arrival_time=arrival, priority=priority)


def _run(scheduler: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 500) -> list[str]:
    """Step until done, adding ``arrivals[step]`` before that step; the finish order."""
    finished: list[str] = []
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        if not scheduler.num_unfinished and step > max(arrivals):
            break
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        tokens = [7 if scheduler.requests[r].num_pending_tokens else None for r in ids]
        before = set(scheduler.requests)
        scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))
        finished += [r for r in ids if r in before and r not in scheduler.requests]
    return finished


def test_fcfs_runs_in_arrival_order() -> None:
    requests = [_request(f"r{i}", 6, 4, priority=5 - i, arrival=float(i)) for i in range(4)]
    assert _run(_scheduler(FcfsPolicy()), {0: requests[:3], 2: requests[3:]}) == ["r0", "r1", "r2", "r3"]


def test_priority_lets_a_later_urgent_request_pass_the_queue() -> None:
    early = [_request(f"r{i}", 6, 4, priority=5, arrival=float(i)) for i in range(3)]
    urgent = _request("urgent", 6, 4, priority=0, arrival=10.0)
    order = _run(_scheduler(PriorityPolicy()), {0: early, 2: [urgent]})
    assert order == ["r0", "urgent", "r1", "r2"]  # r0 was running already: it is not preempted for waiting work


def test_priority_equal_values_are_first_come_first_served() -> None:
    requests = [_request(f"r{i}", 6, 3, priority=1, arrival=float(i)) for i in range(4)]
    assert _run(_scheduler(PriorityPolicy()), {0: requests}) == ["r0", "r1", "r2", "r3"]


def test_preemption_takes_the_lowest_priority_running_request() -> None:
    # 6 blocks of 4 tokens: three requests of 6 prompt tokens (2 blocks each) fill the cache;
    # the first decode that needs a third block must preempt someone
    scheduler = _scheduler(PriorityPolicy(), num_blocks=6, max_seqs=3)
    low = _request("low", 6, 8, priority=9, arrival=0.0)
    high = _request("high", 6, 8, priority=0, arrival=1.0)
    mid = _request("mid", 6, 8, priority=4, arrival=2.0)
    for request in (low, high, mid):
        scheduler.add_request(request)
    preempted: list[str] = []
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        preempted += sorted(out.preempted_req_ids)
        ids = list(out.num_scheduled_tokens)
        tokens = [7 if scheduler.requests[r].num_pending_tokens else None for r in ids]
        scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))
        assert scheduler.kv_cache.num_free_blocks >= 0
    assert preempted and preempted[0] == "low"
    assert "high" not in preempted
    assert not scheduler.num_unfinished
    assert scheduler.kv_cache.num_free_blocks == 6  # every block came back


def test_an_undone_victim_gives_back_its_budget_and_tokens() -> None:
    # the victim (lowest priority) was scheduled earlier in the same step: it is taken back out
    scheduler = _scheduler(PriorityPolicy(), num_blocks=4, max_seqs=2, budget=64)
    low = _request("low", 7, 8, priority=9, arrival=0.0)  # 2 blocks; its first decode still fits in them
    high = _request("high", 8, 8, priority=0, arrival=1.0)  # 2 blocks; its first decode needs a third
    scheduler.add_request(low)
    scheduler.add_request(high)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"low": 7, "high": 8}
    scheduler.update_from_output(out, ModelRunnerOutput(["low", "high"], [7, 7], [None, None]))
    out = scheduler.schedule()  # low is scheduled first, then high finds no block: low is the victim
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.sampling_req_ids == ["high"]
    assert [c.req_id for c in out.cached_reqs] == ["high"]
    assert low.num_pending_tokens == 0 and low.num_computed_tokens == 0
    assert list(scheduler.waiting) == [low]


def test_priority_queue_removal_and_membership() -> None:
    queue = PriorityQueue()
    a, b, c = (_request(n, 2, 1, priority=p, arrival=t) for n, p, t in (("a", 3, 0.0), ("b", 1, 1.0), ("c", 1, 2.0)))
    for request in (a, b, c):
        queue.add(request)
    queue.remove(b)
    assert b not in queue and len(queue) == 2
    assert queue.pop() is c and queue.pop() is a and not queue
    with pytest.raises(ValueError):
        queue.remove(a)


def test_priority_needs_the_priority_policy(tiny_llama) -> None:
    from sonar import LLM

    llm = LLM(tiny_llama, kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), priority=[1])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["hello", "world"], SamplingParams(max_tokens=2), priority=[0])


def test_priority_offline_engine(tiny_llama) -> None:
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_llama, scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], params, priority=5)
    finished: list[str] = []
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 2:
            engine.add_request("urgent", [9, 10, 11, 12], params, priority=-1)
        finished += [o.request_id for o in engine.step() if o.finished]
        steps += 1
    assert finished == ["r0", "urgent", "r1", "r2"]
