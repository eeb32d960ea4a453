"""Pipeline parallelism: which decoder layers a stage holds, and how stages hand tensors on.

A model of ``L`` layers run with ``pipeline_parallel_size=P`` is cut into ``P`` contiguous
stages (an even split, earlier stages taking the remainder, or the partition
``SONAR_PP_LAYER_PARTITION`` gives). Ranks are laid out stage-major: global rank
``pp_rank * tp + tp_rank``. A worker builds its model inside ``building_stage(stage)``; the
model asks ``current_stage()`` once, when it is constructed, and builds only its layers (the
embedding on the first stage, the final norm and LM head on the last). Outside that context
the stage is the whole model on one rank.

Between stages travel the hidden states and the residual of every token of the step
(``IntermediateTensors``), point to point from each tensor-parallel rank to the rank of the
same tensor-parallel index in the next stage, through the platform's communicator.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

PARTITION_ENV = "SONAR_PP_LAYER_PARTITION"


@dataclass(slots=True)
class IntermediateTensors:
    """What a stage hands the next one: ``hidden`` and ``residual``, both ``[T, hidden]``
    (the layer outputs before their residual add, as the next layer's norm fuses it)."""

    hidden: torch.Tensor
    residual: torch.Tensor


def partition_layers(num_layers: int, pp: int) -> list[int]:
    """How many layers each of ``pp`` stages holds: ``SONAR_PP_LAYER_PARTITION`` where set
    (``"3,5"``: 3 layers on the first stage, 5 on the second), else an even split whose
    remainder goes to the earlier stages (the last one also runs the LM head).

    :raises ValueError: a partition that is not ``pp`` positive counts summing to
        ``num_layers``, or more stages than layers.
    """
    raw = os.environ.get(PARTITION_ENV, "").strip()
    if not raw:
        if pp > num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers: every stage needs at least one; "
                f"use pipeline_parallel_size <= {num_layers}"
            )
        base, extra = divmod(num_layers, pp)
        return [base + (1 if stage < extra else 0) for stage in range(pp)]
    parts = [part.strip() for part in raw.split(",")]
    if len(parts) != pp or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(
            f"{PARTITION_ENV}={raw!r} must be {pp} positive layer counts separated by commas, "
            f"one per pipeline stage (pipeline_parallel_size={pp})"
        )
    counts = [int(part) for part in parts]
    if sum(counts) != num_layers:
        raise ValueError(f"{PARTITION_ENV}={raw!r} gives {sum(counts)} layers, but the model has {num_layers}; make them add up")
    return counts


class StageLink:
    """The point-to-point link of one rank to the stages before and after it: ``receive``
    from the previous stage's rank, ``send`` to the next one's (asynchronous: the previous send
    is waited for before the next, so a stage goes on computing while its output travels)."""

    def __init__(self, communicator: Any, prev_rank: int | None, next_rank: int | None) -> None:
        self.communicator = communicator
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._pending: Any = None  # the last send's handle and its buffer

    def receive(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        buffer = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)  # [hidden | residual, T, H]
        self.communicator.recv(buffer, self.prev_rank)
        return IntermediateTensors(buffer[0], buffer[1])

    def send(self, tensors: IntermediateTensors) -> None:
        self.wait()
        buffer = torch.stack([tensors.hidden, tensors.residual])
        self._pending = (self.communicator.send(buffer, self.next_rank), buffer)

    def wait(self) -> None:
        """Wait until the last send has left this rank."""
        if self._pending is not None:
            handle, _ = self._pending
            if handle is not None:
                handle.wait()
            self._pending = None


@dataclass(slots=True)
class PipelineStage:
    """One rank's pipeline stage: its index ``rank`` of ``size`` stages and the decoder layers
    ``start .. end - 1`` of ``num_layers`` it holds; ``link`` talks to its neighbours (None on
    a single stage)."""

    rank: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # None: every layer (a single stage)
    link: StageLink | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline stage {self.rank} is outside {self.size} stages")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def layer_range(self, num_layers: int) -> range:
        """The global indices of this stage's layers in a model of ``num_layers``."""
        end = num_layers if self.end is None else self.end
        if not 0 <= self.start < end <= num_layers:
            raise ValueError(f"pipeline stage {self.rank} holds layers {self.start}..{end - 1}, outside the model's {num_layers}")
        return range(self.start, end)


def stage_of(pp_rank: int, pp: int, num_layers: int, link: StageLink | None = None) -> PipelineStage:
    """Stage ``pp_rank`` of ``pp`` over a model of ``num_layers`` (see ``partition_layers``)."""
    counts = partition_layers(num_layers, pp)
    start = sum(counts[:pp_rank])
    return PipelineStage(pp_rank, pp, start, start + counts[pp_rank], link)


WHOLE_MODEL = PipelineStage()
_building_stage: contextvars.ContextVar[PipelineStage] = contextvars.ContextVar("sonar_pipeline_stage", default=WHOLE_MODEL)


@contextlib.contextmanager
def building_stage(stage: PipelineStage) -> Iterator[None]:
    """Models built inside this context hold only ``stage``'s layers."""
    token = _building_stage.set(stage)
    try:
        yield
    finally:
        _building_stage.reset(token)


def current_stage() -> PipelineStage:
    """The stage a model built now holds (the whole model outside ``building_stage``)."""
    return _building_stage.get()


def join_stage_groups(rank: int, tp: int, pp: int, communicator_cls: type) -> tuple[Any, StageLink | None]:
    """Once every rank joined the default group (``tp * pp`` ranks, stage-major): give this
    rank its stage's tensor-parallel group (``torch.distributed.new_group``, which every rank
    calls for every stage, in order) and its link to the neighbouring stages. Returns
    ``(ParallelGroup of its stage, StageLink or None where pp == 1)``."""
    from sonar.distributed import ParallelGroup

    pp_rank, tp_rank = divmod(rank, tp)
    stage_group = None
    for stage in range(pp):
        members = list(range(stage * tp, (stage + 1) * tp))
        created = torch.distributed.new_group(members) if tp > 1 else None
        if stage == pp_rank:
            stage_group = created
    group = ParallelGroup(tp_rank, tp, communicator_cls(tp, group=stage_group))
    if pp == 1:
        return group, None
    prev_rank = rank - tp if pp_rank > 0 else None
    next_rank = rank + tp if pp_rank < pp - 1 else None
    return group, StageLink(communicator_cls(tp * pp), prev_rank, next_rank)
