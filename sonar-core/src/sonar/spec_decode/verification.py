"""Confidence-scheduled verification: how many of each request's drafts a step verifies.

With fixed verification every draft is verified (up to the step's token budget and the
request's ``max_tokens``) while the batch is within ``disable_by_batch_size``. A draft costs a
token of the target's step whether it survives or not: at batch 1 a step's time barely grows
with its tokens (it reads the weights once), at batch 256 it grows almost linearly (it is
bound by compute), so the same drafts that double a lone request's speed slow a full batch
down.

:class:`ConfidenceVerification` chooses per step. Request ``i`` brings its drafts with
survival estimates ``p_i(j)``, the chance that drafts ``1..j`` all survive (the proposer's,
``DraftTokens.confidence``; for a request without them, the engine's running acceptance by
position, ``SpecDecodeStats``). A step that decodes ``B`` requests and computes ``T0`` other
tokens (decodes, prefill chunks) is expected to emit ``B + sum_i sum_{j <= L_i} p_i(j)``
tokens in ``cost(T0 + sum_i L_i)`` seconds (``StepCostModel``, profiled on the device). For a
total of ``m`` verified drafts the expectation is largest with the ``m`` largest estimates (a
row never increases, so the largest ``m`` always form a prefix of each request's drafts), so
the best choice is the best ``m``: the candidates are sorted once and every prefix of that
order is scored, in O(D log D) for D drafts. This is exact for any cost curve, steps and
plateaus (CUDA graph sizes) included.

Drafting is paid before the choice, whatever is verified. After each step the policy says
whether the next should draft at all (:meth:`ConfidenceVerification.worth_drafting`):
whether a batch of as many decodes, each with drafts of the survival seen lately, would emit
more tokens per second with some drafts verified than without. A step without drafts
overlaps the host's work with the device's (asynchronous scheduling), so it takes the longer
of the two; a step with drafts takes the host's work, the device's and the proposer's in
turn (its tokens are read back before the drafter runs and the next step is scheduled). The
device's part is the cost curve; the proposer's time per step is measured by the worker
(:meth:`ConfidenceVerification.observe_drafting`), the host's per iteration by the engine
core (:meth:`ConfidenceVerification.observe_host`, by batch size, for steps with and without
drafts). On a small target whose steps are mostly host work, that is what decides. If
drafting does not pay, the proposer is skipped (asynchronous scheduling then overlaps the
steps as without speculation), and after ``REPROBE_STEPS`` such steps one drafts anyway, to
refresh what survival and drafting cost look like. Each probe that does not pay either
doubles the wait before the next (up to ``MAX_REPROBE_STEPS``: a loaded server pays for few
probes); the first step whose drafts pay again brings it back to ``REPROBE_STEPS``. In a
batch of more than ``PROBE_ROWS`` decodes a probe drafts for that many requests only, and
the drafting time it measures is scaled up to the whole batch when weighed.
"""

from __future__ import annotations

import itertools

import numpy as np

from sonar.engine.step_cost import StepCostModel
from sonar.spec_decode.stats import SpecDecodeStats

TYPICAL_ROWS = 16  # rows per step that update the typical survival profile
TYPICAL_WEIGHT = 0.2  # weight of a step's rows in that running average
REPROBE_STEPS = 64  # steps without drafting after which one drafts again (the first time)
MAX_REPROBE_STEPS = 1024  # the interval doubles after each probe that did not pay, up to this
DRAFT_WEIGHT = 0.2  # weight of a step's drafting time in its running average
PROBE_ROWS = 8  # requests that draft in a probe (or the first drafting step) of a larger batch
HOST_WEIGHT = 0.1  # weight of an iteration's host time in its running average
HOST_CLIP = 3.0  # an iteration's host time counts at most this many times the running average


class ConfidenceVerification:
    """Chooses each step's verified prefix per request from survival estimates and a step-cost
    curve (see the module).

    :param costs: the target's step time by tokens per step.
    :param num_speculative_tokens: drafts a request may bring (the length of a survival row).
    :param max_num_batched_tokens: the step's token budget (costs up to it are tabulated).
    :param stats: the engine's acceptance counters; the survival estimate of requests whose
        proposer gives none is their acceptance by position.
    """

    def __init__(self, costs: StepCostModel, num_speculative_tokens: int, max_num_batched_tokens: int, stats: SpecDecodeStats) -> None:
        self.costs = costs
        self.num_speculative_tokens = num_speculative_tokens
        self.stats = stats
        self._table = np.asarray(costs.table(2 * max_num_batched_tokens + 1), dtype=np.float64)
        self.typical: list[float] | None = None  # survival by position, lately (None: no drafts seen yet)
        self.draft_seconds: float | None = None  # the proposer's time per step, lately (None: not measured yet)
        self.draft_rows: float | None = None  # requests those steps drafted for, lately (None: as many as asked)
        self._few: str | None = None  # why the last yes may draft for a few only (learning, a probe, prefills)
        self._steps_without_drafting = 0
        self.reprobe_steps = REPROBE_STEPS  # the current interval between probes
        self._probing = False  # the last answer was a probe's yes
        # the engine's host seconds per iteration lately, by batch size (its bit length), of
        # iterations whose step verified drafts and of those that neither verified nor drafted
        self.host_verifying: dict[int, float] = {}
        self.host_plain: dict[int, float] = {}

    def cost(self, num_tokens: int) -> float:
        """Seconds of a step of ``num_tokens`` tokens."""
        table = self._table
        return float(table[num_tokens]) if num_tokens < len(table) else self.costs.cost(num_tokens)

    def observed_survival(self) -> list[float]:
        """The survival estimate of drafts that came without one: by position ``j``, the share
        of verify steps that verified ``j + 1`` drafts or more in which all of them were
        accepted (one prior success and failure each: 0.5 before any step), made
        non-increasing."""
        stats = self.stats
        verified, accepted = stats.verified_per_position, stats.accepted_per_position
        row, low = [], 1.0
        for j in range(self.num_speculative_tokens):
            n = verified[j] if j < len(verified) else 0
            a = accepted[j] if j < len(accepted) else 0
            low = min(low, (a + 1) / (n + 2))
            row.append(low)
        return row

    def choose(
        self, confidences: list[list[float] | None], rooms: list[int], num_sampling: int, base_tokens: int, max_drafts: int
    ) -> list[int]:
        """How many drafts each candidate verifies this step.

        :param confidences: per candidate, its survival estimates by draft position
            (non-increasing), or None (the observed survival stands in).
        :param rooms: per candidate, the most drafts it may verify (its drafts, cut by
            ``max_tokens``).
        :param num_sampling: tokens the step emits without any draft (its decodes).
        :param base_tokens: tokens the step computes besides drafts (``T0``).
        :param max_drafts: the most drafts the step's token budget leaves room for.
        """
        rows: list[list[float] | tuple[()]] = []
        takes: list[int] = []
        fallback = None
        for row, room in zip(confidences, rooms):
            if room <= 0:
                rows.append(())
                takes.append(0)
                continue
            if not row:
                if fallback is None:
                    fallback = self.observed_survival()
                row = fallback
            take = min(room, len(row))
            rows.append(row if take == len(row) else row[:take])
            takes.append(take)
        num_drafts = sum(takes)
        if not num_drafts or max_drafts <= 0:
            return [0] * len(rooms)
        self._update_typical(confidences, fallback)
        values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float64, count=num_drafts)
        owners = np.repeat(np.arange(len(rooms)), takes)
        order = np.argsort(-values, kind="stable")[:max_drafts]  # stable: a row's drafts stay in order
        # tokens per second with the first m drafts of that order, m = 0 .. len(order); the
        # first best wins (no draft that does not pay)
        emitted = num_sampling + np.concatenate(([0.0], np.cumsum(values[order])))
        end = base_tokens + len(order) + 1
        costs = self._table[base_tokens:end] if end <= len(self._table) else np.array([self.cost(t) for t in range(base_tokens, end)])
        best_m = int(np.argmax(emitted / costs))
        counts = np.bincount(owners[order[:best_m]], minlength=len(rooms))
        return counts.tolist()

    def observe_drafting(self, seconds: float, rows: int = 0) -> None:
        """Fold the proposer's time for one step's drafts (the worker's measure) for ``rows``
        requests (0: unknown) into the running drafting cost."""
        if seconds <= 0.0:
            return
        if self.draft_seconds is None:
            self.draft_seconds = seconds
        else:
            self.draft_seconds += DRAFT_WEIGHT * (seconds - self.draft_seconds)
        if rows > 0:
            self.draft_rows = float(rows) if self.draft_rows is None else self.draft_rows + DRAFT_WEIGHT * (rows - self.draft_rows)

    def observe_host(self, num_requests: int, seconds: float, verifying: bool) -> None:
        """Fold the host's time for one engine iteration (scheduling, launching, collecting,
        what the caller does with the outputs: everything but waiting for the device) of a
        decode step of ``num_requests`` requests that verified drafts (``verifying``) or that
        neither verified nor drafted into its running average for that batch size."""
        if seconds <= 0.0 or num_requests <= 0:
            return
        table = self.host_verifying if verifying else self.host_plain
        bucket = num_requests.bit_length()
        current = table.get(bucket)
        table[bucket] = seconds if current is None else current + HOST_WEIGHT * (min(seconds, HOST_CLIP * current) - current)

    def host_seconds(self, num_requests: int) -> tuple[float, float]:
        """The host's seconds per iteration at this batch size lately: of a step without
        drafts, and of one that verifies drafts (as the first where not seen yet; 0 where
        neither was)."""
        bucket = num_requests.bit_length()
        plain = self.host_plain.get(bucket, 0.0)
        return plain, self.host_verifying.get(bucket, plain)

    def drafting_cost(self, num_rows: int) -> float:
        """Seconds of drafting for ``num_rows`` requests: the running measure, scaled up in
        proportion where it was taken on fewer requests (a probe's few), never down."""
        if self.draft_seconds is None:
            return 0.0
        if self.draft_rows is None:
            return self.draft_seconds
        return self.draft_seconds * max(1.0, num_rows / self.draft_rows)

    def worth_drafting(self, num_sampling: int, base_tokens: int) -> bool:
        """Whether the step after one of ``num_sampling`` decodes and ``base_tokens`` tokens
        should draft: whether one draft, or every decode's first ``J`` drafts (any ``J``), of
        the survival seen lately would emit more tokens per second than no drafts, the
        drafting time seen lately added to the step's; else no, but yes again (a probe) after
        ``reprobe_steps`` such answers, an interval that doubles after each probe that did
        not pay. A step of prefills only drafts (for their first verify). How many requests
        draft is ``draft_limit_for``'s to say."""
        self._few = None
        if self.typical is None or num_sampling <= 0:
            self._steps_without_drafting = 0
            self._probing = False
            self._few = "learning" if self.typical is None else "prefills"
            return True
        if self._would_verify(num_sampling, base_tokens):
            self._steps_without_drafting = 0
            self.reprobe_steps = REPROBE_STEPS  # drafting pays again: probe often when it stops
            self._probing = False
            return True
        if self._probing:  # the probe's drafts did not pay either: wait longer before the next
            self.reprobe_steps = min(2 * self.reprobe_steps, MAX_REPROBE_STEPS)
            self._probing = False
        self._steps_without_drafting += 1
        if self._steps_without_drafting >= self.reprobe_steps:
            self._steps_without_drafting = 0
            self._probing = True
            self._few = "probe"
            return True
        return False

    def draft_limit_for(self, num_running: int) -> int | None:
        """After a yes from ``worth_drafting``, for a step of ``num_running`` requests: how
        many draft (None: every one; 0: none, the step does not draft). Where the batch is
        larger than ``PROBE_ROWS``, the first drafting step and a probe draft for that many
        only: enough to measure survival and drafting time, at a fraction of a whole batch's
        drafting cost. A step of prefills drafts for every request where drafts pay at this
        batch, else for none (a burst of arrivals into a loaded engine is no occasion for a
        probe: probes keep their own schedule)."""
        few = self._few
        if few is None or num_running <= PROBE_ROWS:
            return None
        if few == "prefills":  # their drafts are verified in the next step: as many decodes
            return None if self._would_verify(num_running, num_running) else 0
        return PROBE_ROWS

    def _would_verify(self, num_sampling: int, base_tokens: int) -> bool:
        """Whether a step with drafts would emit more tokens per second than one without: a
        step without drafts overlaps the host's work with the device's (asynchronous
        scheduling), so it takes the longer of the two; one with drafts waits for its
        tokens before the drafter runs and the next step is scheduled, so it takes the
        host's work, the device's and the drafting in turn."""
        typical, cost = self.typical, self.cost
        host_plain, host_verifying = self.host_seconds(num_sampling)
        plain = max(cost(base_tokens), host_plain)
        overhead = self.drafting_cost(num_sampling) + host_verifying
        if (num_sampling + typical[0]) * plain > num_sampling * (cost(base_tokens + 1) + overhead):
            return True
        emitted = float(num_sampling)
        for depth, survival in enumerate(typical, start=1):
            emitted += num_sampling * survival
            if emitted * plain > num_sampling * (cost(base_tokens + num_sampling * depth) + overhead):
                return True
        return False

    def _update_typical(self, confidences: list[list[float] | None], fallback: list[float] | None) -> None:
        """Fold a few of this step's survival rows into the running profile (the first rows
        seen make it; a position no row reaches counts as 0 then)."""
        rows = [row or fallback for row in confidences[:TYPICAL_ROWS]]
        weight = TYPICAL_WEIGHT
        if self.typical is None:
            self.typical, weight = [0.0] * self.num_speculative_tokens, 1.0
        typical = self.typical
        for j in range(len(typical)):
            values = [row[j] for row in rows if row is not None and j < len(row)]
            if values:
                typical[j] += weight * (sum(values) / len(values) - typical[j])
