"""``LLM.get_metrics()``: after ``generate`` on a tiny model, the prompt and generated tokens,
finished requests by finish reason, latency histograms and engine gauges, in one process and
over data-parallel replicas; speculative decoding's counters where it is on; and the same
names and buckets as the server's ``/metrics``."""

from __future__ import annotations

import re

import pytest

from conftest import random_prompts
from sonar import LLM, SamplingParams
from sonar.engine.wire import SchedulerStats
from sonar.metrics import Counter, Gauge, Histogram, Metric, Vector

KV_BYTES = 16 << 20
PROMPT_LENS = [5, 12, 30]
MAX_TOKENS = [4, 7, 9]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def by_name(metrics: list[Metric]) -> dict[str, list[Metric]]:
    named: dict[str, list[Metric]] = {}
    for metric in metrics:
        named.setdefault(metric.name, []).append(metric)
    return named


def value(metrics: list[Metric], name: str, **labels: str) -> float:
    [metric] = [m for m in metrics if m.name == name and labels.items() <= m.labels.items()]
    return metric.value


def histogram(metrics: list[Metric], name: str) -> Histogram:
    [metric] = [m for m in metrics if m.name == name]
    assert isinstance(metric, Histogram)
    return metric


def prompts_and_params(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    token_prompts = [random_prompts(1, seed=seed + i, min_len=n, max_len=n)[0] for i, n in enumerate(PROMPT_LENS)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [{"prompt_token_ids": p} for p in token_prompts], params


def assert_counts_of_one_generate(metrics: list[Metric], model_name: str) -> None:
    """The counts ``prompts_and_params`` gives: three requests cut by max_tokens."""
    assert all(m.labels["model_name"] == model_name for m in metrics)
    assert value(metrics, "sonar:request_success", finished_reason="length") == 3
    assert value(metrics, "sonar:request_success", finished_reason="stop") == 0
    assert value(metrics, "sonar:request_success", finished_reason="abort") == 0
    assert value(metrics, "sonar:prompt_tokens") == sum(PROMPT_LENS)
    assert value(metrics, "sonar:generation_tokens") == sum(MAX_TOKENS)
    assert value(metrics, "sonar:engine_prompt_tokens") == sum(PROMPT_LENS)  # nothing was in the prefix cache
    assert value(metrics, "sonar:engine_generation_tokens") == sum(MAX_TOKENS)
    assert value(metrics, "sonar:num_requests_running") == 0
    assert value(metrics, "sonar:num_requests_waiting") == 0
    ttft, itl, e2e = (histogram(metrics, f"sonar:{name}") for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"))
    assert ttft.count == e2e.count == 3
    assert itl.count == sum(n - 1 for n in MAX_TOKENS)  # one token a step: every token after the first
    for hist in (ttft, itl, e2e):
        counts = list(hist.buckets.values())
        assert list(hist.buckets)[-1] == "+Inf" and counts[-1] == hist.count
        assert counts == sorted(counts), "cumulative buckets"
        assert hist.sum > 0
    assert e2e.sum >= ttft.sum


def test_counts_after_generate(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES, served_model_name="tiny")
    before = llm.get_metrics()
    assert value(before, "sonar:prompt_tokens") == 0 and histogram(before, "sonar:time_to_first_token_seconds").count == 0
    prompts, params = prompts_and_params(seed=40)
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == MAX_TOKENS
    metrics = llm.get_metrics()
    assert_counts_of_one_generate(metrics, "tiny")
    assert value(metrics, "sonar:num_kv_blocks_total") == llm.llm_engine.core.cache_config.num_blocks
    assert 0.0 <= value(metrics, "sonar:kv_cache_usage_perc") <= 1.0
    assert not [m for m in metrics if "spec_decode" in m.name], "no speculation, no speculative counters"
    kinds = {m.name: type(m) for m in metrics}
    assert kinds["sonar:prompt_tokens"] is Counter and kinds["sonar:num_requests_running"] is Gauge
    assert all(isinstance(m.value, int) for m in metrics if isinstance(m, Counter))

    # a stop token and an abort
    stop_token = outputs[1].outputs[0].token_ids[2]
    stopped = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[stop_token]))[0]
    assert stopped.outputs[0].finish_reason == "stop" and len(stopped.outputs[0].token_ids) == 3
    engine = llm.llm_engine
    engine.add_request("aborted", prompts[0], SamplingParams(max_tokens=50))
    engine.abort_request(["aborted"])
    metrics = llm.get_metrics()
    assert value(metrics, "sonar:request_success", finished_reason="stop") == 1
    assert value(metrics, "sonar:request_success", finished_reason="abort") == 1
    assert value(metrics, "sonar:request_success", finished_reason="length") == 3
    assert value(metrics, "sonar:prompt_tokens") == sum(PROMPT_LENS) + PROMPT_LENS[1] + PROMPT_LENS[0]
    assert value(metrics, "sonar:generation_tokens") == sum(MAX_TOKENS) + 3
    assert histogram(metrics, "sonar:time_to_first_token_seconds").count == 4  # the aborted one had none
    assert histogram(metrics, "sonar:e2e_request_latency_seconds").count == 5


def test_n_completions_count_every_completion_once(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5, min_len=9, max_len=9)[0]}
    llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    metrics = llm.get_metrics()
    assert value(metrics, "sonar:request_success", finished_reason="length") == 1
    assert value(metrics, "sonar:prompt_tokens") == 9
    assert value(metrics, "sonar:generation_tokens") == 18
    assert value(metrics, "sonar:engine_generation_tokens") == 18


def test_data_parallel_replicas_report_summed_stats(llama_dir) -> None:
    """Two engine-core processes: the request counts are the frontend's own, the engine
    counters are both replicas' summed, as of the outputs that finished the requests."""
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES, data_parallel_size=2)
    try:
        prompts, params = prompts_and_params(seed=60)
        llm.generate(prompts, params)
        metrics = llm.get_metrics()
        assert_counts_of_one_generate(metrics, str(llama_dir))
        num_blocks = value(metrics, "sonar:num_kv_blocks_total")
        assert num_blocks > 0 and num_blocks % 2 == 0, "two replicas' caches of one size"
    finally:
        llm.llm_engine.shutdown()


def test_speculative_decoding_counters(llama_dir) -> None:
    llm = LLM(
        str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(24)] * 2 for i in range(3)]  # each repeats itself
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    metrics = llm.get_metrics()
    stats = llm.llm_engine.get_stats()
    accepted = value(metrics, "sonar:spec_decode_num_accepted_tokens")
    assert accepted == stats.spec_num_accepted_tokens > 0
    assert value(metrics, "sonar:spec_decode_num_draft_tokens") >= accepted
    assert value(metrics, "sonar:spec_decode_num_drafts") == stats.spec_num_drafts > 0
    [per_position] = [m for m in metrics if m.name == "sonar:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and sum(per_position.values) == accepted
    assert value(metrics, "sonar:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outputs) == 72
    # steps that accept drafts add several tokens at once: fewer inter-token observations' steps, same tokens
    assert histogram(metrics, "sonar:inter_token_latency_seconds").count == 72 - 3


def test_names_and_buckets_are_those_of_the_servers_metrics() -> None:
    from sonar.engine.request_stats import RequestStats
    from sonar.engine.scheduler_metrics import scheduler_metrics
    from sonar_server.metrics import ServerMetrics

    stats = SchedulerStats(num_running=2, spec_num_drafts=1, spec_accepted_per_position=[1])
    server = ServerMetrics(lambda: stats, lambda: 0, "m")
    server.observe_finished("api", "stop", 3, 4, 0.5)
    server.observe_first_token(0.1)
    server.observe_inter_token(0.02, 1)
    text = server.render().decode()
    # a counter's family is written with its samples' "_total" suffix, which snapshot names leave off
    families = {
        (name.removesuffix("_total") if kind == "counter" else name, kind)
        for name, kind in re.findall(r"^# TYPE (\S+) (\w+)", text, re.MULTILINE)
    }
    requests = RequestStats()
    requests.observe_finished("stop", 3, 4, 0.5)
    labels = {"model_name": "m"}
    for metric in requests.metrics(labels) + scheduler_metrics(stats, labels, spec_decode=True):
        kind = {Counter: "counter", Vector: "counter", Gauge: "gauge", Histogram: "histogram"}[type(metric)]
        assert (metric.name, kind) in families, f"{metric.name} ({kind}) is not on /metrics"
        if isinstance(metric, Histogram):
            for bound in metric.buckets:
                assert f'{metric.name}_bucket{{le="{bound}",model_name="m"}}' in text
