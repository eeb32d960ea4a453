"""Prometheus metrics: request counters and latency histograms observed by the server, engine
gauges read from the engine client's latest statistics at scrape time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sonar import metrics as snapshots
from sonar.engine.request_stats import E2E_BUCKETS as _E2E_BUCKETS
from sonar.engine.request_stats import LATENCY_BUCKETS as _LATENCY_BUCKETS
from sonar.engine.scheduler_metrics import DESCRIPTIONS, scheduler_metrics
from sonar.metrics import PREFIX

disable_created_metrics()  # no *_created series: they double the output and nobody graphs them


class ServerMetrics:
    """Every metric ``/metrics`` exposes, in its own registry.

    With several API server processes (``PROMETHEUS_MULTIPROC_DIR`` set by ``sonar serve``),
    request counters and histograms are written to files there and every process renders the
    sum over all of them; the engine gauges come from the engine cores, which report to every
    API server, so each process has the whole view of them already.

    :param read_stats: returns the engine's latest ``SchedulerStats`` (or None).
    :param read_in_flight: returns how many requests the server has handed to the engine.
    :param model_name: the ``model_name`` label.
    """

    def __init__(self, read_stats: Callable[[], Any], read_in_flight: Callable[[], int], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.requests = Counter(
            f"{PREFIX}request_success", "Finished requests by API and finish reason",
            ["model_name", "api", "finished_reason"], registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests", ["model_name", "api"], registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens of finished requests", ["model_name", "api"], registry=self.registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time from arrival to the first generated token",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between consecutive generated tokens",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Time from arrival to the last token",
            ["model_name"], buckets=_E2E_BUCKETS, registry=self.registry,
        )
        # the per-token histograms bound to this server's label once (a labels() lookup per
        # token cost about as much as the observation)
        self._time_to_first_token = self.time_to_first_token.labels(model_name)
        self._inter_token_latency = self.inter_token_latency.labels(model_name)
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._read_in_flight = read_in_flight
        self.in_flight: Gauge | None = None
        if self.multiprocess:  # summed over the live API server processes
            self.in_flight = Gauge(
                f"{PREFIX}num_requests_in_flight", "Requests the server has handed to the engine",
                ["model_name"], multiprocess_mode="livesum", registry=None,
            )
            read_in_flight = None  # type: ignore[assignment]
        self.engine_collector = _EngineCollector(read_stats, read_in_flight, model_name)
        self.registry.register(self.engine_collector)

    def update_in_flight(self) -> None:
        """Publish this process's in-flight count (multi-process mode: on every change)."""
        if self.in_flight is not None:
            self.in_flight.labels(self.model_name).set(self._read_in_flight())

    def observe_finished(
        self, api: str, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int, e2e_s: float
    ) -> None:
        self.requests.labels(self.model_name, api, finish_reason).inc()
        self.prompt_tokens.labels(self.model_name, api).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model_name, api).inc(num_generation_tokens)
        self.e2e_latency.labels(self.model_name).observe(e2e_s)

    def observe_first_token(self, ttft_s: float) -> None:
        self._time_to_first_token.observe(ttft_s)

    def observe_inter_token(self, seconds_per_token: float, num_tokens: int) -> None:
        histogram = self._inter_token_latency
        for _ in range(num_tokens):
            histogram.observe(seconds_per_token)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        self.update_in_flight()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.engine_collector)
        return generate_latest(registry)


class _EngineCollector(Collector):
    def __init__(self, read_stats: Callable[[], Any], read_in_flight: Callable[[], int] | None, model_name: str) -> None:
        self.read_stats = read_stats
        self.read_in_flight = read_in_flight
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        if self.read_in_flight is not None:
            family = GaugeMetricFamily(f"{PREFIX}num_requests_in_flight", "Requests the server has handed to the engine", labels=["model_name"])
            family.add_metric([self.model_name], self.read_in_flight())
            yield family
        stats = self.read_stats()
        if stats is None:
            return
        # the engine's figures as LLM.get_metrics() reports them (speculation's zero without it)
        for metric in scheduler_metrics(stats, {"model_name": self.model_name}, spec_decode=True):
            yield _family(metric)


def _family(metric: snapshots.Metric) -> GaugeMetricFamily | CounterMetricFamily:
    """One engine snapshot as a Prometheus metric family (a ``Vector`` one series a position)."""
    description = DESCRIPTIONS[metric.name.removeprefix(PREFIX)]
    names, values = list(metric.labels), list(metric.labels.values())
    if isinstance(metric, snapshots.Gauge):
        family = GaugeMetricFamily(metric.name, description, labels=names)
        family.add_metric(values, metric.value)
    elif isinstance(metric, snapshots.Vector):
        family = CounterMetricFamily(metric.name, description, labels=[*names, "position"])
        for position, count in enumerate(metric.values):
            family.add_metric([*values, str(position)], count)
    else:
        family = CounterMetricFamily(metric.name, description, labels=names)
        family.add_metric(values, metric.value)
    return family
