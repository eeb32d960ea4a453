"""Prometheus metrics: request counters and latency histograms observed by the server, engine
gauges read from the engine client's latest statistics at scrape time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series: they double the output and nobody graphs them

PREFIX = "sonar:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


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
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        if self.read_in_flight is not None:
            yield gauge("num_requests_in_flight", "Requests the server has handed to the engine", self.read_in_flight())
        stats = self.read_stats()
        if stats is None:
            return
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        yield gauge("num_requests_running", "Sequences in the running batch", stats.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)", stats.kv_cache_usage)
        yield gauge("num_kv_blocks_total", "KV-cache blocks", stats.num_total_blocks)
        yield gauge("num_kv_blocks_free", "KV-cache blocks not held by any request", stats.num_free_blocks)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up", hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks", stats.num_preemptions)
        # a KV connector's tier (host offload) or peer (a prefill engine), vLLM's names
        yield counter(
            "external_prefix_cache_queries", "Prompt tokens looked up by the KV connector (host offload tier, prefill peer)",
            stats.external_prefix_cache_queries,
        )
        yield counter("external_prefix_cache_hits", "Prompt tokens the KV connector loaded instead of computing", stats.external_prefix_cache_hits)
        yield counter("kv_transfer_failures", "KV loads that failed (their prompt tokens were computed instead)", stats.num_kv_load_failures)
        yield counter("engine_prompt_tokens", "Prompt tokens computed by the engine", stats.num_prompt_tokens)
        yield counter("engine_generation_tokens", "Tokens generated by the engine", stats.num_generation_tokens)
        yield from _spec_decode_metrics(stats, counter, self.model_name)


def _spec_decode_metrics(stats: Any, counter: Callable[[str, str, float], CounterMetricFamily], model_name: str) -> Iterator[Any]:
    """Speculative decoding's acceptance counters (vLLM's names; zero without speculation)."""
    yield counter("spec_decode_num_proposed_tokens", "Draft tokens proposed (those not verified were cut by the scheduler)", stats.spec_num_proposed_tokens)
    yield counter("spec_decode_num_drafts", "Verify steps that carried drafts, per request", stats.spec_num_drafts)
    yield counter("spec_decode_num_draft_tokens", "Draft tokens verified", stats.spec_num_draft_tokens)
    yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.spec_num_accepted_tokens)
    per_position = CounterMetricFamily(
        f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(stats.spec_accepted_per_position):
        per_position.add_metric([model_name, str(position)], count)
    yield per_position
