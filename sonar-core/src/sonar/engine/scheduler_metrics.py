"""An engine's ``SchedulerStats`` as metric snapshots, under the names ``sonar serve`` exposes
them on ``/metrics``: load gauges, KV-cache and prefix-cache figures, the tokens the engine
computed, and speculative decoding's acceptance counters."""

from __future__ import annotations

from sonar.engine.wire import SchedulerStats
from sonar.metrics import PREFIX, Counter, Gauge, Metric, Vector


def scheduler_metrics(stats: SchedulerStats, labels: dict[str, str], spec_decode: bool = False) -> list[Metric]:
    """Snapshots of ``stats`` (an engine core's, or several summed), each series with
    ``labels``; with ``spec_decode``, speculative decoding's counters too."""

    def gauge(name: str, value: float) -> Gauge:
        return Gauge(f"{PREFIX}{name}", dict(labels), float(value))

    def counter(name: str, value: int) -> Counter:
        return Counter(f"{PREFIX}{name}", dict(labels), int(value))

    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    snapshots: list[Metric] = [
        gauge("num_requests_running", stats.num_running),
        gauge("num_requests_waiting", stats.num_waiting),
        gauge("kv_cache_usage_perc", stats.kv_cache_usage),
        gauge("num_kv_blocks_total", stats.num_total_blocks),
        gauge("num_kv_blocks_free", stats.num_free_blocks),
        gauge("prefix_cache_hit_rate", hit_rate),
        counter("prefix_cache_queries", stats.prefix_cache_queries),
        counter("prefix_cache_hits", stats.prefix_cache_hits),
        counter("num_preemptions", stats.num_preemptions),
        # a KV connector's tier (host offload) or peer (a prefill engine)
        counter("external_prefix_cache_queries", stats.external_prefix_cache_queries),
        counter("external_prefix_cache_hits", stats.external_prefix_cache_hits),
        counter("kv_transfer_failures", stats.num_kv_load_failures),
        counter("engine_prompt_tokens", stats.num_prompt_tokens),
        counter("engine_generation_tokens", stats.num_generation_tokens),
    ]
    if spec_decode:
        snapshots += [
            counter("spec_decode_num_proposed_tokens", stats.spec_num_proposed_tokens),
            counter("spec_decode_num_drafts", stats.spec_num_drafts),
            counter("spec_decode_num_draft_tokens", stats.spec_num_draft_tokens),
            counter("spec_decode_num_accepted_tokens", stats.spec_num_accepted_tokens),
            Vector(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", dict(labels), list(stats.spec_accepted_per_position)),
        ]
    return snapshots
