"""Confidence-scheduled verification: the step-cost model (interpolation, extrapolation, noise
taken out), the policy's choice of verified prefixes (all drafts alone on a flat curve, few or
none in a large batch on a steep one, exact against brute force, monotone in the estimates,
requests without estimates, the step's other tokens), whether to draft at all, the scheduler
applying the plan, and the ``verification`` option."""

from __future__ import annotations

import itertools
import random

import pytest

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.engine.step_cost import StepCostModel, profile_token_counts
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.interface import NO_BATCH_LIMIT, SpeculativeConfig
from sonar.spec_decode.stats import SpecDecodeStats
from sonar.spec_decode.verification import MAX_REPROBE_STEPS, PROBE_ROWS, REPROBE_STEPS, ConfidenceVerification
from sonar.spec_decode.worker_side import survival_row

K = 7


def linear(intercept_ms: float, per_token_ms: float, max_tokens: int = 4096) -> StepCostModel:
    counts = profile_token_counts(max_tokens)
    return StepCostModel.from_samples(counts, [(intercept_ms + per_token_ms * t) / 1000 for t in counts])


FLAT = linear(10.0, 0.0001)  # weight-bound: more tokens barely cost more
STEEP = linear(0.5, 0.05)  # compute-bound: time grows with every token


def policy(costs: StepCostModel, stats: SpecDecodeStats | None = None, k: int = K) -> ConfidenceVerification:
    return ConfidenceVerification(costs, k, 2048, stats or SpecDecodeStats())


def geometric(q: float, k: int = K) -> list[float]:
    return [q ** (j + 1) for j in range(k)]


def expected_rate(costs: StepCostModel, rows: list[list[float]], lengths: list[int], num_sampling: int, base: int) -> float:
    emitted = num_sampling + sum(sum(row[:n]) for row, n in zip(rows, lengths))
    return emitted / costs.cost(base + sum(lengths))


# -- the cost model ----------------------------------------------------------------------


def test_the_profile_grid_counts_every_small_step_then_grows_geometrically():
    counts = profile_token_counts(8192)
    assert counts[:8] == list(range(1, 9)) and counts[-1] == 8192
    assert all(b > a for a, b in zip(counts, counts[1:]))
    assert all(b / a < 1.34 for a, b in zip(counts[8:], counts[9:]))
    assert len(counts) < 45
    assert profile_token_counts(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_tokens"):
        profile_token_counts(0)


def test_the_cost_model_interpolates_extrapolates_and_takes_out_upward_noise():
    model = StepCostModel.from_samples([16, 1, 4, 8], [0.004, 0.001, 0.009, 0.003])  # 4 tokens: a slowed-down run
    assert model.num_tokens == (1, 4, 8, 16)
    assert model.seconds == (0.001, 0.003, 0.003, 0.004)  # the spike at 4 takes the time of 8
    assert model.cost(0) == model.cost(1) == 0.001
    assert model.cost(2) == pytest.approx(0.001 + 0.002 / 3)
    assert model.cost(12) == pytest.approx(0.0035)
    assert model.cost(32) == pytest.approx(0.004 + 16 * 0.004 / 16)  # the last step's time per token: steeper than the last two's slope
    steep_end = StepCostModel.from_samples([1, 8, 16], [0.001, 0.002, 0.010])
    assert steep_end.cost(24) == pytest.approx(0.010 + 8 * 0.008 / 8)  # the last two's slope: steeper
    assert model.table(5) == [model.cost(t) for t in range(6)]
    assert StepCostModel.from_samples([10], [0.002]).cost(20) == pytest.approx(0.004)
    with pytest.raises(ValueError, match="increasing"):
        StepCostModel((2, 1), (0.1, 0.2))
    with pytest.raises(ValueError, match="positive"):
        StepCostModel((1, 2), (0.1, float("nan")))
    with pytest.raises(ValueError, match="one time per token count"):
        StepCostModel((1, 2), (0.1,))


# -- the choice --------------------------------------------------------------------------


def test_a_lone_request_on_a_flat_curve_verifies_every_draft():
    lengths = policy(FLAT).choose([geometric(0.5)], [K], num_sampling=1, base_tokens=1, max_drafts=2047)
    assert lengths == [K]


def test_a_large_batch_on_a_steep_curve_verifies_few_or_none():
    rng = random.Random(0)
    rows = [geometric(rng.uniform(0.4, 0.9)) for _ in range(256)]
    lengths = policy(STEEP).choose(rows, [K] * 256, num_sampling=256, base_tokens=256, max_drafts=1792)
    assert sum(lengths) == 0
    # the same batch where the curve is flat verifies nearly everything
    assert sum(policy(FLAT).choose(rows, [K] * 256, 256, 256, 1792)) > 0.9 * 256 * K
    # a moderately steep curve: only the most confident drafts, first positions first
    middle = linear(5.0, 0.01)
    lengths = policy(middle).choose(rows, [K] * 256, 256, 256, 1792)
    assert 0 < sum(lengths) < 256 * K
    chosen = [row[n - 1] for row, n in zip(rows, lengths) if n]
    left_out = [row[n] for row, n in zip(rows, lengths) if n < K]
    assert min(chosen) >= max(left_out)  # every verified draft is at least as likely as any left out


def test_the_choice_is_the_best_one_by_brute_force_on_any_curve():
    rng = random.Random(1)
    curves = [STEEP, FLAT, linear(3.0, 0.3)]
    # a step curve: a CUDA graph of 4 rows, then eager
    curves.append(StepCostModel.from_samples([1, 4, 5, 8, 16], [0.001, 0.001, 0.004, 0.0045, 0.005]))
    for _ in range(60):
        costs = rng.choice(curves)
        rows = [sorted((rng.random() for _ in range(3)), reverse=True) for _ in range(3)]
        rooms = [rng.randint(0, 3) for _ in rows]
        base = rng.randint(3, 6)
        got = policy(costs, k=3).choose(rows, rooms, 3, base, max_drafts=9)
        best = max(
            expected_rate(costs, rows, list(c), 3, base) for c in itertools.product(*(range(r + 1) for r in rooms))
        )
        assert expected_rate(costs, rows, got, 3, base) == pytest.approx(best)
        assert all(0 <= n <= r for n, r in zip(got, rooms))


def test_higher_survival_never_verifies_fewer_drafts():
    for costs in (linear(5.0, 0.01), linear(2.0, 0.05), linear(10.0, 0.001)):
        for batch in (1, 16, 64):
            totals = [sum(policy(costs).choose([geometric(q)] * batch, [K] * batch, batch, batch, 2048 - batch)) for q in
                      (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)]  # fmt: skip
            assert totals == sorted(totals), (batch, totals)


def test_other_tokens_in_the_step_are_accounted_for():
    # a graph-like curve: flat to 64 tokens (one graph), then twice the time (eager)
    costs = StepCostModel.from_samples([1, 64, 65, 128], [0.005, 0.005, 0.010, 0.012])
    alone = policy(costs).choose([geometric(0.7)], [K], num_sampling=1, base_tokens=1, max_drafts=2047)
    beside_a_prefill = policy(costs).choose([geometric(0.7)], [K], num_sampling=1, base_tokens=60, max_drafts=2047)
    assert alone == [K]
    assert beside_a_prefill == [4]  # the drafts that still fit in the flat part
    assert policy(costs).choose([geometric(0.7)], [K], 1, 1, max_drafts=2) == [2]  # the budget's room


def test_requests_without_estimates_use_the_observed_acceptance():
    stats = SpecDecodeStats()
    chooser = policy(linear(0.5, 0.5), stats)  # a draft costs half a lone decode
    assert chooser.observed_survival() == [0.5] * K  # nothing observed yet: the prior
    assert chooser.choose([None, []], [K, K], 2, 2, 100) == [0, 0]  # None and [] alike: not worth it at 0.5
    for _ in range(200):
        stats.observe(K, K)  # every draft accepted so far
    survival = chooser.observed_survival()
    assert survival[0] > 0.99 and survival == sorted(survival, reverse=True)
    assert chooser.choose([None, []], [K, K], 2, 2, 100) == [K, K]
    assert chooser.choose([None, geometric(0.2)], [K, K], 2, 2, 100) == [K, 0]  # a request's own estimates win
    for _ in range(400):
        stats.observe(K, 0)  # then none
    assert chooser.choose([None], [K], 1, 1, 100) == [0]
    assert chooser.choose([geometric(0.99)], [0], 1, 1, 100) == [0]  # no room: nothing


def test_drafting_stops_where_nothing_would_be_verified_and_probes_again():
    steep = policy(STEEP)
    assert policy(FLAT).worth_drafting(256, 256)
    steep.typical = [0.6] * K  # as a step's drafts leave it
    answers = [steep.worth_drafting(256, 256) for _ in range(REPROBE_STEPS)]
    assert not any(answers[:-1]) and answers[-1]  # one probe after REPROBE_STEPS refusals
    assert steep.worth_drafting(1, 1)  # a lone request on the same curve: its drafts cost little
    assert steep.worth_drafting(0, 512)  # no decodes: prefills draft for their first verify


def test_probes_that_do_not_pay_come_ever_less_often():
    steep = policy(STEEP)
    steep.typical = [0.6] * K
    intervals, waited = [], 0
    for _ in range(REPROBE_STEPS * (1 + 2 + 4 + 8 + 16 + 16)):
        waited += 1
        if steep.worth_drafting(256, 256):  # a probe: its drafts did not pay (the next answer is no again)
            intervals.append(waited)
            waited = 0
    assert intervals[:6] == [REPROBE_STEPS * f for f in (1, 2, 4, 8, 16, 16)]  # doubling, up to MAX_REPROBE_STEPS
    assert MAX_REPROBE_STEPS == 16 * REPROBE_STEPS
    assert steep.worth_drafting(1, 1)  # drafting pays (a lone request): probes are frequent again
    assert steep.reprobe_steps == REPROBE_STEPS
    answers = [steep.worth_drafting(256, 256) for _ in range(REPROBE_STEPS)]
    assert not any(answers[:-1]) and answers[-1]


def test_probes_and_the_first_drafting_step_of_a_large_batch_draft_for_a_few():
    steep = policy(STEEP)
    assert steep.worth_drafting(256, 256) and steep.draft_limit_for(256) == PROBE_ROWS  # nothing seen yet: learn on a few
    assert steep.draft_limit_for(4) is None  # a small batch drafts whole
    steep.typical = [0.6] * K
    answers, limits = [], []
    for _ in range(REPROBE_STEPS):
        answers.append(steep.worth_drafting(256, 256))
        limits.append(steep.draft_limit_for(256) if answers[-1] else None)
    assert answers[-1] and limits[-1] == PROBE_ROWS and not any(answers[:-1])  # the probe: a few requests
    # prefills into a batch whose drafts would not pay: nobody drafts (0), and the probe schedule goes on
    assert steep.worth_drafting(0, 256) and steep.draft_limit_for(256) == 0
    assert steep.draft_limit_for(4) is None  # into a small batch: every request drafts
    flat = policy(FLAT)
    flat.typical = [0.9] * K
    assert flat.worth_drafting(256, 256) and flat.draft_limit_for(256) is None  # drafting pays: every request
    assert flat.worth_drafting(0, 512) and flat.draft_limit_for(256) is None


def test_drafting_time_measured_on_a_few_requests_is_scaled_up_to_the_batch():
    chooser = policy(linear(10.0, 0.01))
    chooser.observe_drafting(0.004, rows=PROBE_ROWS)  # a probe: 4 ms for 8 requests
    assert chooser.drafting_cost(PROBE_ROWS) == pytest.approx(0.004)
    assert chooser.drafting_cost(256) == pytest.approx(0.004 * 256 / PROBE_ROWS)
    assert chooser.drafting_cost(1) == pytest.approx(0.004)  # never scaled down
    chooser.observe_drafting(0.010, rows=256)  # then a whole batch
    assert chooser.draft_rows == pytest.approx(PROBE_ROWS + 0.2 * (256 - PROBE_ROWS))
    unknown = policy(linear(10.0, 0.01))
    unknown.observe_drafting(0.004)  # rows not given: taken as they are
    assert unknown.drafting_cost(256) == pytest.approx(0.004)


def test_drafting_that_costs_more_than_its_drafts_give_is_stopped():
    curve = linear(10.0, 0.01)  # a step of 256 decodes: 12.56 ms
    chooser = policy(curve)
    chooser.typical = geometric(0.7)
    assert chooser.worth_drafting(256, 256)
    chooser.observe_drafting(0.020)  # 20 ms of drafting a step: more than any verification wins back here
    assert chooser.draft_seconds == 0.020
    assert not chooser.worth_drafting(256, 256)
    assert chooser.worth_drafting(1, 1)  # a lone request's drafts still pay for that
    rows = [geometric(0.7)] * 4
    assert chooser.choose(rows, [K] * 4, 4, 4, 100) == policy(curve).choose(rows, [K] * 4, 4, 4, 100)  # paid already: no part of the choice
    chooser.observe_drafting(0.010)
    assert chooser.draft_seconds == pytest.approx(0.020 + 0.2 * (0.010 - 0.020))  # a running average


def test_drafts_must_pay_for_the_host_time_a_speculative_step_no_longer_overlaps():
    """A small target: a one-token step of 0.64 ms on the device, 0.9 ms of host work a plain
    step (the two overlap), 1.1 ms a verify step, 0.6 ms of drafting. A speculative step runs
    host, device and drafter in turn (2.6 ms for 2.85 tokens) against 0.9 ms a token
    without: not worth it, though the device's costs alone (1.5 ms against 0.64) say it is."""
    curve = linear(0.6, 0.04)
    chooser = policy(curve)
    chooser.typical = [0.6, 0.4, 0.27, 0.2, 0.15, 0.12, 0.1]  # drafts emit 1.84 more tokens a step
    chooser.observe_drafting(0.0006, rows=1)
    assert chooser.worth_drafting(1, 1)
    chooser.observe_host(1, 0.0009, verifying=False)
    chooser.observe_host(1, 0.0011, verifying=True)
    assert chooser.host_seconds(1) == (0.0009, 0.0011)
    assert not chooser.worth_drafting(1, 1)
    # the same host beside a large target's 20 ms step: what the drafts save dwarfs it
    large = policy(linear(20.0, 0.01))
    large.typical = chooser.typical
    large.observe_drafting(0.0006, rows=1)
    large.observe_host(1, 0.0009, verifying=False)
    large.observe_host(1, 0.0011, verifying=True)
    assert large.worth_drafting(1, 1)


def test_host_time_is_kept_by_batch_size_and_a_stray_iteration_counts_little():
    chooser = policy(FLAT)
    assert chooser.host_seconds(64) == (0.0, 0.0)  # nothing seen: the device's cost alone decides
    chooser.observe_host(64, 0.002, verifying=False)
    assert chooser.host_seconds(64) == (0.002, 0.002)  # a verify step's unseen: as a plain one's
    assert chooser.host_seconds(100) == (0.002, 0.002)  # 64..127 share a size class
    assert chooser.host_seconds(128) == (0.0, 0.0)
    chooser.observe_host(64, 10.0, verifying=False)  # a pause (a collection, a descheduled process)
    assert chooser.host_seconds(64)[0] == pytest.approx(0.002 + 0.1 * (3 * 0.002 - 0.002))
    chooser.observe_host(64, -1.0, verifying=True)  # nonsense is ignored
    chooser.observe_host(0, 0.001, verifying=True)
    assert chooser.host_verifying == {}


def test_a_choice_at_batch_256_with_7_drafts_is_cheap():
    import time

    rng = random.Random(2)
    rows = [geometric(rng.uniform(0.3, 0.95)) for _ in range(256)]
    chooser = policy(linear(7.0, 0.002, 8192))
    chooser.choose(rows, [K] * 256, 256, 256, 1792)
    started = time.perf_counter()
    for _ in range(20):
        chooser.choose(rows, [K] * 256, 256, 256, 1792)
    assert (time.perf_counter() - started) / 20 < 0.02  # about 0.5 ms on one idle core


# -- survival rows from the worker -------------------------------------------------------


def test_survival_rows_are_plain_clamped_non_increasing_floats():
    assert survival_row([0.9, 0.95, 0.5, float("nan"), 0.2], 4) == [0.9, 0.9, 0.5, 0.0]
    assert survival_row((1.5, -0.1), 2) == [1.0, 0.0]
    assert survival_row([0.9], 3) is None  # fewer estimates than drafts
    torch = pytest.importorskip("torch")
    row = survival_row(torch.tensor([0.8, 0.6, 0.7]), 3)
    assert row == pytest.approx([0.8, 0.6, 0.6]) and all(type(v) is float for v in row)


# -- the scheduler -----------------------------------------------------------------------


def _decoding(scheduler: Scheduler, count: int, drafts: int = K, confidence: list[float] | None = None) -> list[Request]:
    """``count`` requests past their prefill, each holding ``drafts`` drafts."""
    requests = []
    for i in range(count):
        request = Request(f"r{i}", [100 * i + j for j in range(5)], SamplingParams(max_tokens=50), [0], 50)
        scheduler.add_request(request)
        requests.append(request)
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    output = ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids))
    output.draft_token_ids = {r: [11] * drafts for r in ids}
    if confidence is not None:
        output.draft_confidence = {r: list(confidence) for r in ids}
    scheduler.update_from_output(out, output)
    return requests


def _scheduler(costs: StepCostModel | None, max_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_seqs, 2048, 512, spec_max_batch_size=NO_BATCH_LIMIT)
    scheduler = Scheduler(config, KVCacheManager(4096, 16))
    if costs is not None:
        scheduler.verification = ConfidenceVerification(costs, K, 2048, scheduler.spec_stats)
    return scheduler


def test_the_scheduler_verifies_what_the_policy_chose_and_counts_the_cut():
    flat = _scheduler(FLAT)
    _decoding(flat, 1, confidence=geometric(0.8))
    out = flat.schedule()
    assert out.scheduled_spec_decode_tokens == {"r0": [11] * K} and out.num_scheduled_tokens == {"r0": 1 + K}
    assert out.propose_drafts

    steep = _scheduler(STEEP)
    _decoding(steep, 64, confidence=geometric(0.6))
    out = steep.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    assert all(n == 1 for n in out.num_scheduled_tokens.values())
    assert steep.spec_stats.num_proposed_tokens == 64 * K and steep.spec_stats.num_draft_tokens == 0
    assert not out.propose_drafts  # a batch like this one is not worth drafting for

    fixed = _scheduler(None)
    _decoding(fixed, 64, confidence=geometric(0.6))
    assert sum(map(len, fixed.schedule().scheduled_spec_decode_tokens.values())) == 64 * K  # fixed: every draft


def test_a_burst_of_arrivals_drafts_only_where_drafts_would_pay():
    steep = _scheduler(STEEP, max_seqs=128)
    steep.verification.typical = [0.6] * K  # survival seen before
    for i in range(64):  # 64 prompts at once: the step is prefills only
        steep.add_request(Request(f"p{i}", [100 * i + j for j in range(5)], SamplingParams(max_tokens=50), [0], 50))
    out = steep.schedule()
    assert len(out.num_scheduled_tokens) == 64 and not out.propose_drafts and out.draft_limit is None

    flat = _scheduler(FLAT, max_seqs=128)
    flat.verification.typical = [0.9] * K
    for i in range(64):
        flat.add_request(Request(f"p{i}", [100 * i + j for j in range(5)], SamplingParams(max_tokens=50), [0], 50))
    out = flat.schedule()
    assert out.propose_drafts and out.draft_limit is None  # drafts pay on this curve: all 64 draft for their first verify


def test_preemption_clears_drafts_and_their_estimates():
    scheduler = _scheduler(FLAT)
    (request,) = _decoding(scheduler, 1, confidence=geometric(0.8))
    assert request.spec_confidence == geometric(0.8)
    scheduler._preempt(scheduler.running.pop())
    assert request.spec_token_ids == [] and request.spec_confidence is None


# -- the option --------------------------------------------------------------------------


def test_the_verification_option_defaults_by_method_and_is_checked():
    assert SpeculativeConfig.from_value({"method": "dspark", "model": None}).verification == "confidence"
    ngram = SpeculativeConfig.from_value({"method": "ngram"})
    assert ngram.verification == "fixed" and ngram.max_batch_size == 32
    confident = SpeculativeConfig.from_value({"method": "ngram", "verification": "confidence"})
    assert confident.max_batch_size == NO_BATCH_LIMIT  # the policy decides, unless a limit is given
    assert SpeculativeConfig.from_value({"method": "ngram", "verification": "confidence", "disable_by_batch_size": 8}).max_batch_size == 8
    assert SpeculativeConfig.from_value({"method": "dspark", "verification": "fixed"}).verification == "fixed"
    adaptive = SpeculativeConfig.from_value({"method": "ngram", "enable_adaptive_verification": True})
    assert adaptive.verification == "confidence" and "enable_adaptive_verification" not in adaptive.extra
    assert SpeculativeConfig.from_value({"method": "dspark", "enable_adaptive_verification": False}).verification == "fixed"
    with pytest.raises(ValueError, match='must be "fixed" or "confidence", got .adaptive.'):
        SpeculativeConfig.from_value({"method": "ngram", "verification": "adaptive"})
    with pytest.raises(ValueError, match="must be \"fixed\" or \"confidence\", got 1"):
        SpeculativeConfig.from_value({"method": "ngram", "verification": 1})
    with pytest.raises(ValueError, match="enable_adaptive_verification.*true or false"):
        SpeculativeConfig.from_value({"method": "ngram", "enable_adaptive_verification": "yes"})
    with pytest.raises(ValueError, match="contradicts"):
        SpeculativeConfig.from_value({"method": "ngram", "enable_adaptive_verification": True, "verification": "fixed"})
