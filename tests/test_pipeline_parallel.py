"""Pipeline parallelism on the CPU: real worker processes over gloo, the layers split into
stages that hand their hidden states on point to point, give the greedy tokens (and logprobs)
of one device, itself tested equal to transformers; alone (PP=2) and with tensor parallelism
inside each stage (TP=2 x PP=2; for Mixtral with expert parallelism) on every tiny
architecture. Several micro-batches are in flight at once, and a rank that dies fails the
engine."""

from __future__ import annotations

import os
import re
import time

import pytest

from sonar import LLM, SamplingParams
from sonar.pipeline import PARTITION_ENV, partition_layers
from sonar_models.testing import build_tiny_model
from tp_compare import assert_a_killed_rank_fails_the_engine

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13], [5, 900, 17, 3, 44, 8, 2, 19, 6, 33, 71]]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
ENGINE = dict(kv_cache_memory_bytes=1 << 24, max_model_len=128, max_num_seqs=8)
# (architecture, tensor_parallel_size, pipeline_parallel_size, config overrides, layer partition,
# engine options); every architecture once, each kind of split once (the MoE ones at TP=2 x PP=2,
# where the experts' split meets the stages'), in real processes: the slowest test module on CI
CASES = [
    ("llama", 1, 2, dict(num_hidden_layers=3), "1,2", {}),  # an uneven partition from the environment
    ("mistral", 1, 2, {}, None, {}),  # also: preemptions of requests with a step in flight (SMALL_CACHE)
    ("qwen2", 1, 2, {}, None, {}),  # tied embedding: the last stage's LM head loads it
    ("qwen3_moe", 1, 2, {}, None, {}),  # stage 0 holds the sparse layer, stage 1 the dense one
    ("llama", 2, 2, dict(num_hidden_layers=3), None, {}),  # 2 + 1 layers, each stage two ranks
    ("qwen2_moe", 2, 2, {}, None, {}),  # shared expert's partial sums in each stage's all-reduce
    ("qwen3_moe", 2, 2, {}, None, {}),  # each expert's intermediate size split within the sparse stage
    ("mixtral", 2, 2, {}, None, dict(enable_expert_parallel=True)),  # whole experts per rank, all-to-all in each stage
    ("qwen3", 2, 2, dict(num_key_value_heads=1), None, {}),  # one KV head replicated within each stage
]
# many requests, few tokens per step: the engine core fills the pipeline with micro-batches
MANY_PROMPTS = [[7 + i, 3 * i + 1, 40 + i, 9, 2 + i] for i in range(8)]
MANY_ENGINE = dict(ENGINE, max_num_batched_tokens=12)
# longer prompts than the cache holds at once, two micro-batches: running requests are preempted
LONG_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(14)] for i in range(8)]
SMALL_CACHE = dict(kv_cache_memory_bytes=24 << 10, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=20)


def _engine_options(arch: str, pp: int, tp: int) -> dict:
    if arch == "llama":
        return MANY_ENGINE
    if arch == "mistral" and (pp, tp) == (2, 1):
        return SMALL_CACHE
    return ENGINE


def _case_id(case: tuple) -> str:
    arch, tp, pp, _, _, options = case
    return f"{arch}-tp{tp}-pp{pp}" + ("-ep" if options.get("enable_expert_parallel") else "")


def _generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per case: one device's outputs and the parallel engine's; the PP=2 Llama engine also
    serves many requests at once (its executor's peak in flight is read), the PP=2 Mistral
    engine long prompts in a small cache, the PP=2 Qwen2 engine a grammar; the last engine is
    kept for the fault test (the others are shut down as soon as they answered)."""
    results: dict = {}
    singles: dict = {}
    for index, case in enumerate(CASES):
        arch, tp, pp, overrides, partition, options = case
        path = build_tiny_model(arch, tmp_path_factory.mktemp(arch), **overrides)
        key = (arch, tuple(sorted(overrides.items())))
        if key not in singles:
            single = LLM(str(path), **MANY_ENGINE if arch == "llama" else ENGINE)
            extra = {"llama": MANY_PROMPTS, "mistral": LONG_PROMPTS}.get(arch)
            singles[key] = (_generate(single), extra and _generate(single, extra), _guided(single) if arch == "qwen2" else None)
        if partition is not None:
            os.environ[PARTITION_ENV] = partition
        try:
            engine = _engine_options(arch, pp, tp)
            llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine, **options)
        finally:
            os.environ.pop(PARTITION_ENV, None)
        results[_case_id(case)] = (singles[key][0], _generate(llm))
        if arch == "llama" and pp == 2 and tp == 1:
            executor = llm.llm_engine.core.executor
            executor.peak_in_flight = 0
            results["many"] = (singles[key][1], _generate(llm, MANY_PROMPTS), executor.peak_in_flight)
        if arch == "mistral" and (pp, tp) == (2, 1):
            core = llm.llm_engine.core
            results["preempted"] = (singles[key][1], _generate(llm, LONG_PROMPTS), core.scheduler.num_preemptions, core.executor.peak_in_flight)
        if arch == "qwen2" and (pp, tp) == (2, 1):  # structured output: the matchers follow the last stage's tokens
            results["guided"] = (singles[key][2], _guided(llm))
        if index == len(CASES) - 1:
            results["kept"] = llm
        else:
            llm.llm_engine.core.executor.shutdown()
    return results


def _guided(llm: LLM) -> list[str]:
    from sonar.structured_output import GuidedDecodingParams

    params = SamplingParams(max_tokens=10, temperature=0.0, guided_decoding=GuidedDecodingParams(regex="(cat|dog)[0-9]{2}"))
    return [o.outputs[0].text for o in llm.generate(["Pick one:", "Animal:"], params)]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_stages_match_one_device(runs, case: tuple) -> None:
    single, parallel = runs[_case_id(case)]
    for one, two in zip(single, parallel):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            assert set(a) == set(b)
            for token_id, logprob in a.items():
                assert b[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)


def test_micro_batches_fill_the_pipeline(runs) -> None:
    single, parallel, peak_in_flight = runs["many"]
    assert peak_in_flight == 2  # both stages busy: as many steps in flight as stages, never more
    assert [o.outputs[0].token_ids for o in parallel] == [o.outputs[0].token_ids for o in single]


def test_preempting_requests_with_a_step_in_flight(runs) -> None:
    single, parallel, num_preemptions, peak_in_flight = runs["preempted"]
    assert num_preemptions > 0 and peak_in_flight == 2
    assert [o.outputs[0].token_ids for o in parallel] == [o.outputs[0].token_ids for o in single]


def test_structured_output_through_stages(runs) -> None:
    single, parallel = runs["guided"]
    assert parallel == single
    assert all(re.fullmatch("(cat|dog)[0-9]{2}", text) for text in parallel)


def test_a_killed_rank_fails_the_engine_cleanly(runs) -> None:
    # TP=2 x PP=2, four ranks: rank 1 is of the first stage, not the one that answers
    assert_a_killed_rank_fails_the_engine(runs["kept"], _generate, rank=1)


def test_layer_partitions(monkeypatch) -> None:
    assert partition_layers(5, 2) == [3, 2]  # the remainder on the earlier stages
    assert partition_layers(4, 4) == [1, 1, 1, 1]
    monkeypatch.setenv(PARTITION_ENV, "1, 4")
    assert partition_layers(5, 2) == [1, 4]
    for raw, message in [
        ("3,3", "gives 6 layers, but the model has 5"),
        ("5", "must be 2 positive layer counts"),
        ("0,5", "must be 2 positive layer counts"),
        ("a,b", "must be 2 positive layer counts"),
    ]:
        monkeypatch.setenv(PARTITION_ENV, raw)
        with pytest.raises(ValueError, match=message):
            partition_layers(5, 2)


def test_what_does_not_pipeline_yet_is_refused(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 does not combine with enable_lora yet"):
        LLM(str(tmp_path), pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 does not combine with speculative_config yet"):
        LLM(str(tmp_path), pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(str(tmp_path), pipeline_parallel_size=0)
    path = build_tiny_model("llama", tmp_path / "llama")  # two layers
    started = time.monotonic()  # refused before any process starts
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(str(path), pipeline_parallel_size=3, **ENGINE)
    monkeypatch.setenv(PARTITION_ENV, "2,1")
    with pytest.raises(ValueError, match="gives 3 layers, but the model has 2"):
        LLM(str(path), pipeline_parallel_size=2, **ENGINE)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ValueError, match="needs a process per rank"):
        LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="uni", **ENGINE)
    assert time.monotonic() - started < 10
