"""Metric snapshots, as ``LLM.get_metrics()`` returns them (the types of vLLM's
``vllm.v1.metrics.reader``).

Each snapshot is one series: a ``name`` (those ``sonar serve`` exposes on ``/metrics``, with the
``sonar:`` prefix; a counter's name without Prometheus's ``_total`` suffix) and its ``labels``
(``model_name`` on every series, ``finished_reason`` on ``sonar:request_success``). Values are
totals since the engine started, or for a gauge its value as of the latest step.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "sonar:"


@dataclass(slots=True)
class Metric:
    """One series of a metric: its name and labels."""

    name: str
    labels: dict[str, str]


@dataclass(slots=True)
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass(slots=True)
class Gauge(Metric):
    """A value that goes up and down (a request count, a fraction of the KV cache)."""

    value: float


@dataclass(slots=True)
class Histogram(Metric):
    """Observations (latencies, in seconds) counted in buckets.

    ``buckets`` maps each bucket's upper bound, as Prometheus writes it (``"0.005"``, ...,
    ``"+Inf"``), to the number of observations at or below it: cumulative, so
    ``buckets["+Inf"] == count``. ``sum`` is the total of the observations.
    """

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass(slots=True)
class Vector(Metric):
    """Counters by position (``values[i]``: position ``i``), where ``/metrics`` has one series
    per ``position`` label: draft tokens accepted at each position of a draft."""

    values: list[int]
