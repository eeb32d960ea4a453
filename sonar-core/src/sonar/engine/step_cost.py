"""What a step of the target model costs, by the number of tokens it computes: measured on the
device at start-up, interpolated by the engine core."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PROFILE_GROWTH = 1.25  # the token counts profiled grow by this factor (every count up to 8)


def profile_token_counts(max_tokens: int, growth: float = PROFILE_GROWTH) -> list[int]:
    """The token counts a cost profile measures: 1, 2, ..., 8, then a geometric grid of
    ``growth`` up to ``max_tokens`` (which is always the last)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if growth <= 1.0:
        raise ValueError(f"growth must be > 1, got {growth}")
    counts = list(range(1, min(8, max_tokens) + 1))
    value = float(counts[-1])
    while counts[-1] < max_tokens:
        value *= growth
        counts.append(min(max_tokens, max(counts[-1] + 1, round(value))))
    return counts


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Seconds one forward step of the target takes, as a function of the tokens in it.

    Built from a profile: ``num_tokens`` (increasing) and the ``seconds`` each took, measured
    with decode-shaped batches (``min(tokens, max_num_seqs)`` sequences, each with a context of
    ``context_len`` tokens; more tokens than sequences are laid out as verify steps, several
    query tokens a sequence) through the worker's own step path, CUDA graphs included.
    :meth:`from_samples` turns raw measurements into a model: it sorts them and makes the
    curve non-decreasing, each count taking the least time measured at it or at any larger
    count (a step of more tokens never costs less, and timing noise only ever adds time: a
    process descheduled mid-step, a busy host).

    :meth:`cost` interpolates linearly between the profiled counts, answers the first count's
    time below it, and extrapolates past the last linearly, with the slope of the last two
    counts or, if steeper, the last step's time per token (a large step is bound by compute,
    so its time grows linearly; a profile cut short by its time budget, or ending on a
    plateau, must not make further tokens look free). :meth:`table` precomputes the costs
    of every count up to a limit, for lookups on the scheduler's hot path.

    Plain data (tuples of numbers): it crosses process boundaries as it is, and a scheduler
    can use it without torch.
    """

    num_tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    context_len: int = 0

    def __post_init__(self) -> None:
        if not self.num_tokens or len(self.num_tokens) != len(self.seconds):
            raise ValueError(
                f"a step cost model needs one time per token count, got {len(self.num_tokens)} counts and {len(self.seconds)} times"
            )
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])) or self.num_tokens[0] < 1:
            raise ValueError(f"token counts must be positive and increasing, got {list(self.num_tokens)}")
        if any(not s > 0 for s in self.seconds):  # also refuses NaN
            raise ValueError(f"step times must be positive, got {list(self.seconds)}")

    @classmethod
    def from_samples(cls, num_tokens: list[int], seconds: list[float], context_len: int = 0) -> StepCostModel:
        """A model from measurements in any order (the faster of two at one count); the curve
        is made non-decreasing from the right (see the class)."""
        pairs = sorted(zip(num_tokens, seconds))
        counts, times = [], []
        for count, time_s in pairs:
            if counts and count == counts[-1]:
                times[-1] = min(times[-1], time_s)  # the same count twice: the faster run
                continue
            counts.append(int(count))
            times.append(float(time_s))
        for i in range(len(times) - 2, -1, -1):
            times[i] = min(times[i], times[i + 1])
        return cls(tuple(counts), tuple(times), context_len)

    def cost(self, num_tokens: float) -> float:
        """Seconds of a step of ``num_tokens`` tokens."""
        counts, times = self.num_tokens, self.seconds
        if num_tokens <= counts[0]:
            return times[0]
        if num_tokens >= counts[-1]:
            slope = times[-1] / counts[-1]
            if len(counts) > 1:
                slope = max(slope, (times[-1] - times[-2]) / (counts[-1] - counts[-2]))
            return times[-1] + slope * (num_tokens - counts[-1])
        i = bisect.bisect_right(counts, num_tokens)
        left, right = counts[i - 1], counts[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (num_tokens - left) / (right - left)

    def table(self, max_tokens: int) -> list[float]:
        """``cost(t)`` for every ``t`` in ``0 .. max_tokens``."""
        return [self.cost(t) for t in range(max_tokens + 1)]

    def as_rows(self) -> list[tuple[int, float]]:
        """``(tokens, milliseconds)`` per profiled count, for reports."""
        return [(count, round(1000 * time_s, 4)) for count, time_s in zip(self.num_tokens, self.seconds)]
