"""Structured output lives in the engine core: its manager owns the matchers and sends each
step's bitmask with the scheduler output; the worker only applies it."""

from __future__ import annotations

import json

import pytest

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.sampling_params import SamplingParams
from sonar.structured_output.params import GuidedDecodingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("so-core")
    build_tiny_model("llama", folder)
    return LLMEngine(EngineArgs(model=str(folder), kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=256))


def test_the_step_carries_the_bitmask_of_constrained_sampling_requests(engine: LLMEngine) -> None:
    seen = []
    executor = engine.core.executor
    launch = executor.launch

    def spy(scheduler_output):
        seen.append((list(scheduler_output.sampling_req_ids), list(scheduler_output.grammar_req_ids),
                     None if scheduler_output.grammar_bitmask is None else tuple(scheduler_output.grammar_bitmask.shape)))
        return launch(scheduler_output)

    executor.launch = spy
    try:
        choice = SamplingParams(max_tokens=8, temperature=0.0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
        free = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request("constrained", "Answer:", choice)
        engine.add_request("free", "Hello", free)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    finally:
        del executor.launch
    assert outputs["constrained"].outputs[0].text in ("yes", "no")
    words = -(-engine.config.vocab_size // 32)
    first = seen[0]
    assert set(first[0]) == {"constrained", "free"}
    assert first[1] == ["constrained"] and first[2] == (1, words)
    assert all("free" not in grammar_ids for _, grammar_ids, _ in seen)
    assert not engine.core.structured_output.grammars  # dropped once the request finished
    runner = engine.core.executor.worker.model_runner
    assert not any("grammar" in name or "structured" in name for name in vars(runner))  # no grammar state in the worker


def test_a_json_request_is_valid_json_with_the_worker_holding_nothing(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, guided_decoding=GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    engine.add_request("json", "Data:", params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["a"], int)
    else:  # cut by max_tokens: still a prefix the grammar allows
        assert text.startswith("{")


def test_boolean_schemas_and_a_string_choice():
    """The JSON schema ``true`` is any JSON value (``{}``), ``false`` matches nothing, and a
    choice given as one string (not a list of them) is refused rather than split into letters."""
    assert GuidedDecodingParams(json=True).json == {}
    assert GuidedDecodingParams(json="true").json == {}
    for bad in (dict(json=False), dict(json="false"), dict(choice="yes"), dict(choice=5)):
        with pytest.raises(ValueError):
            GuidedDecodingParams(**bad)


def test_the_seeds_of_several_choices_wrap_around():
    from sonar.engine.input_processor import choice_seed

    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert [choice_seed(2**64 - 2, i) for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert choice_seed(-(2**63), 1) == -(2**63) + 1 and choice_seed(None, 3) is None
