"""The scheduler under pipeline parallelism: a request with a step in flight is left out of
the next steps until its results are back, and the output tokens the earlier stages have not
seen travel with the request's next step."""

from __future__ import annotations

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.sampling_params import SamplingParams


def _scheduler(pp: int, budget: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 256, pipeline_parallel_size=pp), KVCacheManager(64, 4))


def _add(scheduler: Scheduler, request_id: str, num_prompt: int) -> Request:
    offset = 1000 * (len(scheduler.requests) + 1)
    request = Request(request_id, list(range(offset, offset + num_prompt)), SamplingParams(max_tokens=8), [0], 8)
    scheduler.add_request(request)
    return request


def _finish_step(scheduler: Scheduler, out: SchedulerOutput, token: int) -> None:
    ids = list(out.num_scheduled_tokens)
    tokens = [token if req_id in out.sampling_req_ids else None for req_id in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))


def test_a_request_in_flight_is_not_scheduled_again() -> None:
    scheduler = _scheduler(pp=2)
    for name in ("a", "b", "c"):
        _add(scheduler, name, 4)
    first = scheduler.schedule()  # a and b fill the budget
    assert dict(first.num_scheduled_tokens) == {"a": 4, "b": 4}
    second = scheduler.schedule()  # a second micro-batch: only c, a and b are in the pipeline
    assert dict(second.num_scheduled_tokens) == {"c": 4}
    assert scheduler.schedule().is_empty  # everything is in flight
    _finish_step(scheduler, first, token=7)
    third = scheduler.schedule()
    assert dict(third.num_scheduled_tokens) == {"a": 1, "b": 1}
    # the stages before the last learn the sampled tokens from the step
    assert {c.req_id: c.new_token_ids for c in third.cached_reqs} == {"a": [7], "b": [7]}
    _finish_step(scheduler, second, token=9)
    _finish_step(scheduler, third, token=8)
    fourth = scheduler.schedule()  # a micro-batch takes half the requests (rounded up): two of three
    assert {c.req_id: c.new_token_ids for c in fourth.cached_reqs} == {"a": [8], "b": [8]}
    fifth = scheduler.schedule()
    assert {c.req_id: c.new_token_ids for c in fifth.cached_reqs} == {"c": [9]}
    assert scheduler.in_flight == {"a", "b", "c"}


def test_micro_batches_share_the_requests() -> None:
    scheduler = _scheduler(pp=2, budget=64)
    for i in range(5):
        _add(scheduler, f"r{i}", 4)
    sizes = [len(scheduler.schedule().num_scheduled_tokens) for _ in range(3)]
    assert sizes == [3, 2, 0]  # every stage a micro-batch; the third waits for a result


def test_without_pipeline_parallelism_nothing_is_tracked() -> None:
    scheduler = _scheduler(pp=1)
    _add(scheduler, "a", 4)
    first = scheduler.schedule()
    _finish_step(scheduler, first, token=7)
    second = scheduler.schedule()
    assert scheduler.in_flight is None
    assert [c.new_token_ids for c in second.cached_reqs] == [[]]
