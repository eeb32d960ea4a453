"""The registered sampler stages, in their default order, and what requests may say about them:
stage names and ids in ``sampler_priority``, stage parameters in ``extra_args``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sonar.sampler.stage import SamplerStage, StageParam, as_stage_param

if TYPE_CHECKING:
    from sonar.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MAX_CACHED_ORDERS = 256
TEMPERATURE_STAGE = "temperature"  # what temperature_last moves to the end


@dataclass(slots=True)
class StageTable:
    """Every registered stage, looked up by name, alias or id."""

    ordered: tuple[SamplerStage, ...]  # the default order of the orderable stages
    final: tuple[SamplerStage, ...]  # after them, in rank order
    by_name: dict[str, SamplerStage]  # names and aliases, lower case
    by_id: dict[int, SamplerStage]
    params: dict[str, tuple[SamplerStage, StageParam]]  # extra_args name -> (stage, spec)
    _orders: dict[tuple[tuple[int | str, ...] | None, bool], tuple[SamplerStage, ...]] = field(default_factory=dict)

    @property
    def stages(self) -> tuple[SamplerStage, ...]:
        return self.ordered + self.final

    @property
    def param_stages(self) -> tuple[SamplerStage, ...]:
        return tuple(stage for stage in self.stages if stage.params)

    def lookup(self, value: int | str) -> SamplerStage:
        """An orderable stage by id (``5``, ``"5"``) or name (``"temperature"``); ValueError otherwise."""
        if isinstance(value, str):
            key = value.strip().lower()
            if key in self.by_name:
                stage = self.by_name[key]
                if stage.final:
                    raise ValueError(f"sampler {value!r} always runs after the ordered stages and cannot be reordered")
                return stage
            if not key.lstrip("-").isdigit():
                raise ValueError(f"unknown sampler {value!r}; known: {sorted(n for n, s in self.by_name.items() if not s.final)}")
            value = int(key)
        if isinstance(value, bool) or not isinstance(value, int) or value not in self.by_id:
            raise ValueError(f"unknown sampler id {value!r}; ids are {sorted(self.by_id)}")
        return self.by_id[value]

    @staticmethod
    def priority_key(stage: SamplerStage) -> int | str:
        """How ``sampler_priority`` stores a stage: its id where it has one, else its name."""
        return int(stage.sampler_id) if stage.sampler_id is not None else stage.name

    def order(self, priority: list[int | str] | None, temperature_last: bool) -> tuple[SamplerStage, ...]:
        """One request's stage order: its ``sampler_priority`` first, then the stages it did not
        list in the default order; with ``temperature_last`` temperature moves to the end."""
        if not priority and not temperature_last:
            return self.ordered
        key = (tuple(priority) if priority else None, temperature_last)
        cached = self._orders.get(key)
        if cached is not None:
            return cached
        order = self.ordered
        if priority:
            listed = tuple(self.lookup(p) for p in priority)
            order = listed + tuple(s for s in self.ordered if s not in listed)
        if temperature_last:
            order = tuple(s for s in order if s.name != TEMPERATURE_STAGE) + tuple(
                s for s in order if s.name == TEMPERATURE_STAGE
            )
        if len(self._orders) >= _MAX_CACHED_ORDERS:
            self._orders.clear()
        self._orders[key] = order
        return order

    def check_extra_args(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field when a namespaced ``extra_args`` key belongs to no
        registered stage or its value does not fit; then run the ``validate`` of each stage whose
        parameters the request sets. Keys without a dot are left alone (free-form extra arguments)."""
        for name, value in (params.extra_args or {}).items():
            if "." not in name:
                continue
            if name not in self.params:
                raise ValueError(
                    f'extra_args["{name}"] is not a parameter of any registered sampler stage; '
                    f"registered stage parameters: {sorted(self.params)} (install the plugin that provides it)"
                )
            _, spec = self.params[name]
            spec.validate(name, value)
        extra = params.extra_args or {}
        for stage in self.param_stages:
            if any(name in extra for name in stage.params):
                stage.validate(params)

    def reads_output_tokens(self, params: SamplingParams) -> bool:
        """Whether a stage this request uses through ``extra_args`` reads earlier sampled tokens."""
        return any(stage.reads_output_tokens and stage.uses(params) for stage in self.param_stages)


def build_stage_table(registered: list[Any]) -> StageTable:
    """Order the registered stages (instances, classes or ``"module:Name"`` paths). A stage
    that cannot be loaded, reuses a name, id or parameter, or is anchored to a stage that does
    not exist is logged and left out; the others still work."""
    from sonar.registry import import_class

    stages: list[SamplerStage] = []
    by_name: dict[str, SamplerStage] = {}
    by_id: dict[int, SamplerStage] = {}
    params: dict[str, tuple[SamplerStage, StageParam]] = {}
    for entry in registered:
        try:
            stage = _instantiate(import_class(entry) if isinstance(entry, str) else entry)
            names = [stage.name.lower(), *(alias.lower() for alias in stage.aliases)]
            specs = {name: as_stage_param(spec) for name, spec in stage.params.items()}
            _check_unique(stage, names, specs, by_name, by_id, params)
        except Exception as exc:  # noqa: BLE001 - a broken stage never takes the others down
            logger.warning("sampler stage %r was skipped: %s", entry, exc)
            continue
        stages.append(stage)
        by_name.update({name: stage for name in names})
        if stage.sampler_id is not None:
            by_id[stage.sampler_id] = stage
        params.update({name: (stage, spec) for name, spec in specs.items()})

    ordered = _default_order([s for s in stages if not s.final])
    final = _default_order([s for s in stages if s.final])
    placed = set(ordered) | set(final)
    for stage in stages:
        if stage not in placed:
            logger.warning("sampler stage %r was skipped: it is ordered relative to an unregistered stage", stage.name)
            by_name = {name: s for name, s in by_name.items() if s is not stage}
            by_id = {i: s for i, s in by_id.items() if s is not stage}
            params = {name: entry for name, entry in params.items() if entry[0] is not stage}
    return StageTable(ordered=tuple(ordered), final=tuple(final), by_name=by_name, by_id=by_id, params=params)


def _instantiate(target: Any) -> SamplerStage:
    stage = target() if isinstance(target, type) else target
    if not isinstance(stage, SamplerStage):
        raise TypeError(f"{target!r} is not a sonar.sampler.SamplerStage")
    if not stage.name or stage.name != stage.name.lower():
        raise ValueError(f"a sampler stage needs a lower-case name, got {stage.name!r}")
    anchors = [stage.rank is not None, stage.after is not None, stage.before is not None]
    if sum(anchors) > 1:
        raise ValueError(f"sampler stage {stage.name!r} sets more than one of rank, after and before")
    return stage


def _check_unique(
    stage: SamplerStage, names: list[str], specs: dict[str, StageParam], by_name: dict[str, SamplerStage],
    by_id: dict[int, SamplerStage], params: dict[str, tuple[SamplerStage, StageParam]],
) -> None:  # fmt: skip
    taken = [name for name in names if name in by_name]
    if taken:
        raise ValueError(f"names {taken} are taken by another stage")
    if stage.sampler_id is not None and stage.sampler_id in by_id:
        raise ValueError(f"sampler id {stage.sampler_id} is taken by {by_id[stage.sampler_id].name!r}")
    for name in specs:
        if "." not in name:
            raise ValueError(f"parameter {name!r} must be namespaced (\"{stage.name}.{name}\")")
        if name in params:
            raise ValueError(f"parameter {name!r} is declared by stage {params[name][0].name!r} too")


def _default_order(stages: list[SamplerStage]) -> list[SamplerStage]:
    """Ranked stages by (rank, name), unranked ones without an anchor after them by name, then
    each anchored stage next to its anchor (siblings by name); stages whose anchor never
    appears are left out."""
    anchored = sorted((s for s in stages if s.after is not None or s.before is not None), key=lambda s: s.name)
    free = [s for s in stages if s.after is None and s.before is None]
    order = sorted(free, key=lambda s: (s.rank is None, s.rank or 0.0, s.name))
    last_after: dict[str, SamplerStage] = {}
    progress = True
    while anchored and progress:
        progress = False
        for stage in list(anchored):
            anchor = (stage.after or stage.before or "").lower()
            position = next((i for i, s in enumerate(order) if anchor in (s.name, *s.aliases)), None)
            if position is None:
                continue
            if stage.after is not None:
                previous = last_after.get(anchor)
                position = (order.index(previous) if previous is not None else position) + 1
                last_after[anchor] = stage
            order.insert(position, stage)
            anchored.remove(stage)
            progress = True
    return order
