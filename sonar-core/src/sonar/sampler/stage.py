"""The sampler-stage interface: one step of the sampler that edits a batch of logits.

A stage is registered through ``sonar_register_sampler_stages`` (Sonar's own stages too). It
says which requests use it (``uses``), builds that step's tensors for their rows (``build``)
and applies them (``apply``). A step where no request uses a stage costs one check per row and
no tensor work. A third-party stage takes its request parameters from
``SamplingParams.extra_args``, under namespaced names it declares in ``params``; they are
validated when the request is created, and a bad value is a ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sonar.sampling_params import is_sampler_float

if TYPE_CHECKING:
    from sonar.sampler.logits_processor import LogitsProcessor
    from sonar.sampler.metadata import RequestSamplingState
    from sonar.sampling_params import SamplingParams

_TYPE_REQUIREMENTS: dict[type, str] = {
    float: "must be a number",
    int: "must be an integer",
    bool: "must be a boolean",
    str: "must be a string",
    list: "must be a list",
    dict: "must be an object",
}


@dataclass(frozen=True, slots=True)
class StageParam:
    """One request parameter of a stage, sent as ``SamplingParams.extra_args[name]``.

    :param type: ``float`` (any finite number; integers too), ``int``, ``bool``, ``str``,
        ``list`` or ``dict``.
    :param default: the value a stage reads (``SamplerStage.param``) when a request leaves
        the parameter out.
    :param check: an extra condition on a value of the right type; a value failing it is
        rejected with ``requirement`` as the reason.
    :param requirement: what ``check`` demands, as the end of a sentence: ``"must be in [0, 1]"``.
    :param doc: one line for documentation and error messages.
    """

    type: type = float
    default: Any = None
    check: Callable[[Any], bool] | None = None
    requirement: str = ""
    doc: str = ""

    def validate(self, name: str, value: Any) -> None:
        """Raise ValueError, naming ``extra_args["name"]``, when ``value`` does not fit."""
        if not _has_type(value, self.type):
            raise ValueError(f'extra_args["{name}"] {_TYPE_REQUIREMENTS[self.type]}, got {value!r}')
        if self.check is not None and not self.check(value):
            raise ValueError(f'extra_args["{name}"] {self.requirement or "is invalid"}, got {value!r}')


def _has_type(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and is_sampler_float(value)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def as_stage_param(spec: StageParam | type) -> StageParam:
    """``float`` → ``StageParam(float)``; a ``StageParam`` as it is."""
    if isinstance(spec, StageParam):
        return spec
    if spec not in _TYPE_REQUIREMENTS:
        raise ValueError(f"a stage parameter's type must be one of {[t.__name__ for t in _TYPE_REQUIREMENTS]}, got {spec!r}")
    return StageParam(type=spec)


@dataclass(slots=True)
class StageContext:
    """What ``SamplerStage.apply`` may need besides its own tensors.

    :param states: the request state of each row of the logits it is given.
    :param batch_rows: the position of each of those rows in the step's whole batch.
    :param logits_processor: the sampler's instance of a registered logits processor, by name.
    """

    states: list[RequestSamplingState]
    batch_rows: list[int]
    logits_processor: Callable[[str], LogitsProcessor]


class SamplerStage:
    """One step of the sampler. Subclass it, set the class attributes, implement ``build`` and
    ``apply``, and register an instance (or the class, or its ``"module:Name"`` path) through
    ``sonar_register_sampler_stages``.

    Attributes:

    - ``name``: unique, lower case; what ``sampler_priority`` lists (``aliases`` work too).
    - ``sampler_id``: the stage's integer id in ``sampler_priority`` (Aphrodite's ids for the
      built-in stages); None for none.
    - where it runs by default, one of: ``after = "min_p"`` (right after that stage),
      ``before = "xtc"`` (right before it), or ``rank`` (a number: the built-in stages have
      ranks 100, 200, ... in their default order, so 650 sits between the 6th and 7th). Stages
      anchored to the same stage run in name order; a stage with none of them runs last.
    - ``final``: runs after every orderable stage, in rank order, and ``sampler_priority``
      cannot move it (mirostat).
    - ``covers_greedy``: True for a penalty-like stage, applied to greedy rows too (whose
      token is the argmax after it); False (the default) for a stage that shapes the
      distribution, applied to randomly sampled rows only.
    - ``reads_output_tokens``: True when ``build`` reads the values of earlier sampled tokens
      (such requests are not stepped ahead of their previous token).
    - ``params``: the namespaced ``extra_args`` names the stage reads (``"example.boost"``), each
      a ``StageParam`` or just its type (``float``).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    sampler_id: ClassVar[int | None] = None
    rank: ClassVar[float | None] = None
    after: ClassVar[str | None] = None
    before: ClassVar[str | None] = None
    final: ClassVar[bool] = False
    covers_greedy: ClassVar[bool] = False
    reads_output_tokens: ClassVar[bool] = False
    params: ClassVar[Mapping[str, StageParam | type]] = {}

    def uses(self, params: SamplingParams) -> bool:
        """Whether a request uses this stage; by default, whether its ``extra_args`` sets one
        of the stage's parameters. Called for every row of every step: keep it cheap."""
        extra = params.extra_args
        return extra is not None and any(name in extra for name in self.params)

    def validate(self, params: SamplingParams) -> None:
        """Checks across parameters, for a request that sets any of the stage's ``params`` (each
        parameter's own type and ``check`` are already verified). Raise ValueError naming the
        field."""

    def param(self, params: SamplingParams, name: str) -> Any:
        """The request's value of the stage parameter ``name``, or its declared default."""
        extra = params.extra_args
        if extra is not None and name in extra:
            return extra[name]
        return as_stage_param(self.params[name]).default

    def build(
        self, states: list[RequestSamplingState], rows: list[int], vocab_size: int, device: torch.device
    ) -> Any | None:
        """This step's tensors for the stage.

        :param states: one per logits row of the batch (or of a group of rows sharing a stage
            order), in row order.
        :param rows: the rows that use the stage (ascending, never empty): those whose
            ``uses`` is true, random rows only unless ``covers_greedy``.
        :returns: anything ``apply`` understands, or None to skip the stage this step.
        """
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        """Apply the stage: ``logits`` ``[B, V]`` float32 holds the rows ``build`` was given
        ``states`` for. Return the new logits; working in place is fine."""
        raise NotImplementedError

    def on_sampled(self, tensors: Any, probs: torch.Tensor, sampled: torch.Tensor) -> None:
        """After the step's draw (when some row was sampled at random): ``probs`` ``[B, V]`` is
        the distribution the random rows were drawn from, ``sampled`` ``[B]`` the chosen ids.
        A stateful stage updates its requests' state here (mirostat's mu); the default does
        nothing."""

    def __repr__(self) -> str:
        return f"<sampler stage {self.name!r}>"
