"""What a frontend counts of its requests: finished requests by finish reason, their prompt and
generated tokens, and the latency histograms (first token, between tokens, end to end), under
the names and buckets ``sonar serve`` uses on ``/metrics``."""

from __future__ import annotations

from bisect import bisect_left

from sonar.metrics import PREFIX, Counter, Histogram, Metric

# bucket upper bounds, in seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
FINISH_REASONS = ("stop", "length", "abort")  # always reported, zero or not


class HistogramCounts:
    """One histogram's observations, counted per bucket as they come."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` (``times`` observations of it)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def snapshot(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            buckets["+Inf" if bound == float("inf") else str(float(bound))] = total
        return Histogram(name, dict(labels), total, self.sum, buckets)


class RequestStats:
    """Counters and latency histograms of a frontend's requests (times in seconds)."""

    def __init__(self) -> None:
        self.num_finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.time_to_first_token = HistogramCounts(LATENCY_BUCKETS)
        self.inter_token_latency = HistogramCounts(LATENCY_BUCKETS)
        self.e2e_latency = HistogramCounts(E2E_BUCKETS)

    def observe_tokens(self, arrival: float, previous_token_time: float | None, now: float, num_tokens: int) -> None:
        """A request got ``num_tokens`` new tokens at ``now`` (its earlier ones at
        ``previous_token_time``; None: these are its first): its first token's latency, then
        each later token's share of the time since the previous ones."""
        if previous_token_time is None:
            self.time_to_first_token.observe(now - arrival)
        else:
            self.inter_token_latency.observe((now - previous_token_time) / num_tokens, num_tokens)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int, e2e_s: float) -> None:
        self.num_finished[finish_reason] = self.num_finished.get(finish_reason, 0) + 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.e2e_latency.observe(e2e_s)

    def metrics(self, labels: dict[str, str]) -> list[Metric]:
        """Snapshots of every counter and histogram, each series with ``labels``."""
        snapshots: list[Metric] = [
            Counter(f"{PREFIX}request_success", {**labels, "finished_reason": reason}, count)
            for reason, count in self.num_finished.items()
        ]
        snapshots += [
            Counter(f"{PREFIX}prompt_tokens", dict(labels), self.num_prompt_tokens),
            Counter(f"{PREFIX}generation_tokens", dict(labels), self.num_generation_tokens),
            self.time_to_first_token.snapshot(f"{PREFIX}time_to_first_token_seconds", labels),
            self.inter_token_latency.snapshot(f"{PREFIX}inter_token_latency_seconds", labels),
            self.e2e_latency.snapshot(f"{PREFIX}e2e_request_latency_seconds", labels),
        ]
        return snapshots
