"""Sampler stages as plugins: the default order, where third-party stages slot in, their
parameters under ``extra_args``, and what a batch pays for a stage nobody uses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from sonar import registry
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.sampler import (
    RequestSamplingState,
    Sampler,
    SamplerStage,
    SamplingMetadata,
    StageParam,
)
from sonar.sampler.stage_table import build_stage_table
from sonar.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 32
BUILTIN_ORDER = [
    "dry", "penalties", "no_repeat_ngram", "temperature", "top_nsigma", "top_p_top_k", "top_a", "min_p", "tfs",
    "eta_cutoff", "epsilon_cutoff", "typical_p", "quadratic", "xtc",
]  # fmt: skip


class Shift(SamplerStage):
    """Adds ``test.shift`` to token 0; counts its builds and draws (a real stage, not a mock)."""

    name = "test_shift"
    after = "min_p"
    params: ClassVar[dict[str, Any]] = {"test.shift": StageParam(float, check=lambda v: v >= 0, requirement="must be >= 0"), "test.note": str}

    def __init__(self) -> None:
        self.built_rows: list[list[int]] = []
        self.num_sampled = 0

    def build(self, states: list[RequestSamplingState], rows: list[int], vocab_size: int, device: torch.device) -> Any:
        self.built_rows.append(rows)
        shifts = [self.param(states[row].params, "test.shift") for row in rows]
        return torch.tensor(rows), torch.tensor(shifts, dtype=torch.float32)

    def apply(self, logits: torch.Tensor, tensors: Any, context: Any) -> torch.Tensor:
        rows, shifts = tensors
        logits[rows, 0] += shifts
        return logits

    def on_sampled(self, tensors: Any, probs: torch.Tensor, sampled: torch.Tensor) -> None:
        self.num_sampled += 1


def named(name: str, **attributes: Any) -> SamplerStage:
    return type(name, (SamplerStage,), {"name": name, **attributes})()


def state(params: SamplingParams) -> RequestSamplingState:
    return RequestSamplingState(params=params, prompt_token_ids=[1, 2, 3], output_token_ids=[], generator=None, eos_token_ids=[])


@pytest.fixture
def shift() -> Iterator[Shift]:
    """``Shift`` registered through the hook for the test's duration."""
    stage = Shift()

    class Plugin:
        @hookimpl
        def sonar_register_sampler_stages(self, register):
            register(stage)

    plugin = Plugin()
    get_plugin_manager().register(plugin, name="test-shift-stage")
    registry.clear_caches()
    try:
        yield stage
    finally:
        get_plugin_manager().unregister(plugin)
        registry.clear_caches()


# --- order ----------------------------------------------------------------------------------------


def test_builtin_stages_come_through_the_hook_in_the_default_order() -> None:
    table = registry.sampler_stages()
    assert [s.name for s in table.ordered] == BUILTIN_ORDER
    assert [s.name for s in table.final] == ["mirostat"]
    assert [table.lookup(i).name for i in (0, 5, 13)] == ["top_p_top_k", "temperature", "xtc"]
    assert table.lookup("Top_K") is table.lookup("top_p") is table.lookup("0")


def test_third_party_stages_slot_in_deterministically() -> None:
    table = build_stage_table(
        [named("b_after", after="min_p"), named("a_after", after="min_p"), named("ranked", rank=450),
         named("before_xtc", before="xtc"), named("chained", after="a_after"), named("unanchored"),
         *[named(n, rank=100 * (i + 1)) for i, n in enumerate(BUILTIN_ORDER)]]
    )  # fmt: skip
    names = [s.name for s in table.ordered]
    assert names[names.index("temperature") + 1] == "ranked"
    assert names[names.index("min_p") :][:4] == ["min_p", "a_after", "chained", "b_after"]
    assert names[-3:] == ["before_xtc", "xtc", "unanchored"]


def test_broken_stages_are_left_out_and_the_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    table = build_stage_table(
        [named("ok", rank=1), named("ok"), named("lost", after="nowhere"), named("Upper"),
         named("flat", rank=2, params={"undotted": float}), "no.such.module:Stage"]
    )  # fmt: skip
    assert [s.name for s in table.ordered] == ["ok"]
    assert "lost" not in table.by_name
    assert caplog.text.count("was skipped") == 5


def test_sampler_priority_takes_plugin_stage_names_and_rejects_unknown_ones(shift: Shift) -> None:
    params = SamplingParams(sampler_priority=["test_shift", "temperature", 13])
    assert params.sampler_priority == ["test_shift", 5, 13]
    order = [s.name for s in registry.sampler_stages().order(params.sampler_priority, params.temperature_last)]
    assert order[:3] == ["test_shift", "temperature", "xtc"] and len(order) == len(BUILTIN_ORDER) + 1
    with pytest.raises(ValueError, match="sampler_priority: unknown sampler 'no_such_stage'"):
        SamplingParams(sampler_priority=["no_such_stage"])
    with pytest.raises(ValueError, match="sampler_priority: sampler 'mirostat' always runs after"):
        SamplingParams(sampler_priority=["mirostat"])


# --- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,message",
    [({"test.shift": "x"}, 'extra_args["test.shift"] must be a number, got \'x\''),
     ({"test.shift": -1.0}, 'extra_args["test.shift"] must be >= 0, got -1.0'),
     ({"test.shift": True}, 'extra_args["test.shift"] must be a number'),
     ({"test.note": 3}, 'extra_args["test.note"] must be a string'),
     ({"test.typo": 1}, 'extra_args["test.typo"] is not a parameter of any registered sampler stage')],
)  # fmt: skip
def test_stage_parameters_are_validated_naming_the_field(shift: Shift, extra: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(extra_args=extra)
    assert str(info.value).startswith(message)
    if "typo" in message:
        assert "['test.note', 'test.shift']" in str(info.value)


def test_keys_without_a_namespace_pass_through() -> None:
    assert SamplingParams(extra_args={"free_form": [1, 2]}).extra_args == {"free_form": [1, 2]}
    with pytest.raises(ValueError, match="extra_args must map parameter names to values"):
        SamplingParams(extra_args=[1, 2])  # type: ignore[arg-type]


# --- the batch ------------------------------------------------------------------------------------


def test_a_batch_where_nobody_uses_a_stage_never_builds_it(shift: Shift) -> None:
    states = [state(SamplingParams(temperature=0.7)), state(SamplingParams(temperature=0.0))]
    meta = SamplingMetadata.build(states, VOCAB, CPU)
    assert shift.built_rows == [] and "test_shift" not in (meta.stage_tensors or {})
    Sampler()(torch.randn(2, VOCAB), meta)
    assert shift.num_sampled == 0


def test_a_stage_runs_on_its_random_rows_only(shift: Shift) -> None:
    uses = {"test.shift": 1000.0}
    states = [
        state(SamplingParams(temperature=0.0, extra_args=uses)),  # greedy: a shaping stage leaves it alone
        state(SamplingParams(temperature=1.0)),
        state(SamplingParams(temperature=1.0, extra_args=uses)),
    ]
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 3.0
    out = Sampler()(logits, SamplingMetadata.build(states, VOCAB, CPU))
    assert shift.built_rows == [[2]] and shift.num_sampled == 1
    assert out.sampled_token_ids[0] == 5 and out.sampled_token_ids[2] == 0


def test_a_penalty_like_stage_changes_the_greedy_argmax(shift: Shift) -> None:
    Shift.covers_greedy = True
    try:
        states = [state(SamplingParams(temperature=0.0, extra_args={"test.shift": 10.0})), state(SamplingParams(temperature=0.0))]
        logits = torch.zeros(2, VOCAB)
        logits[:, 5] = 3.0
        out = Sampler()(logits, SamplingMetadata.build(states, VOCAB, CPU))
    finally:
        Shift.covers_greedy = False
    assert out.sampled_token_ids.tolist() == [0, 5]
