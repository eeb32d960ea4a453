"""Acceptance counters of speculative decoding, as the engine core reports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sonar.engine.scheduler_output import RequestLogprobs


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals since the engine started: draft tokens proposed (the proposer's, as they
    reached the scheduler), verify steps with drafts (``num_drafts``), draft tokens verified,
    drafts accepted, and by position (index 0: the first draft of a step) the drafts verified
    and accepted. Proposed minus verified is what the scheduler cut: the batch-size limit of
    fixed verification, the policy of confidence-scheduled verification, a request's budget
    or ``max_tokens``, a request that finished first."""

    num_proposed_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one request's verify step: ``num_accepted`` of its ``num_draft_tokens`` kept."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        accepted, verified = self.accepted_per_position, self.verified_per_position
        if len(verified) < num_draft_tokens:
            grow = [0] * (num_draft_tokens - len(verified))
            verified.extend(grow)
            accepted.extend(grow)
        for position in range(num_draft_tokens):
            verified[position] += 1
        for position in range(num_accepted):
            accepted[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 (the target's own) plus the drafts it kept."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def spec_decode_stats_fields(stats: SpecDecodeStats) -> dict[str, Any]:
    """The ``SchedulerStats`` fields that carry ``stats``."""
    return {
        "spec_num_proposed_tokens": stats.num_proposed_tokens,
        "spec_num_drafts": stats.num_drafts,
        "spec_num_draft_tokens": stats.num_draft_tokens,
        "spec_num_accepted_tokens": stats.num_accepted_tokens,
        "spec_accepted_per_position": list(stats.accepted_per_position),
        "spec_verified_per_position": list(stats.verified_per_position),
    }


def truncated_logprobs(logprobs: RequestLogprobs | None, num_tokens: int) -> RequestLogprobs | None:
    """The logprobs of a verify step's first ``num_tokens`` tokens (those before a stop)."""
    if logprobs is None or len(logprobs.token_ids) <= num_tokens:
        return logprobs
    return RequestLogprobs(logprobs.token_ids[:num_tokens], logprobs.logprobs[:num_tokens], logprobs.ranks[:num_tokens])


def sum_per_position(left: list[int], right: list[int]) -> list[int]:
    """Two engines' counts by position, added position by position."""
    longer, shorter = (left, right) if len(left) >= len(right) else (right, left)
    return [count + (shorter[i] if i < len(shorter) else 0) for i, count in enumerate(longer)]
