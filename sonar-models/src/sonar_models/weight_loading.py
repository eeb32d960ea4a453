"""Copying Hugging Face-named checkpoint tensors into a model with fused projections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from sonar_models.layers import Linear, MergedLinear


@dataclass(slots=True, frozen=True)
class FusedProjection:
    """Checkpoint module ``checkpoint_name`` is part ``part`` of the model's ``fused_name``."""

    checkpoint_name: str  # "q_proj"
    fused_name: str  # "qkv_proj"
    part: str  # "q"


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: Iterable[FusedProjection],
    ignored_suffixes: tuple[str, ...] = (),
    skipped_names: frozenset[str] = frozenset(),
    resolve: Callable[[str], tuple[str, Any] | None] | None = None,
) -> None:
    """Copy each ``(name, tensor)`` into ``model``; tensors stream through one at a time, into
    a linear layer through its ``LinearMethod`` (which knows how a quantized tensor packs).

    ``ignored_suffixes`` (``rotary_emb.inv_freq``) and ``skipped_names`` (``lm_head.weight`` of a
    tied model) are dropped. ``resolve``, tried before ``fused``, maps a name to ``(parameter
    name, part)`` or None: a part of a module that is not a linear layer is the region its
    owner's ``part_rows(part)`` indexes, and such an owner lists the parts each parameter
    expects with ``checkpoint_parts(leaf)`` (stacked experts do). An owner with
    ``shard_checkpoint_tensor(leaf, tensor, part)`` (a layer sharded for tensor parallelism)
    gets this rank's piece of each full checkpoint tensor; one with
    ``load_checkpoint_part(leaf, tensor, part)`` that returns True keeps the part itself
    (quantized experts). Raises ``ValueError`` on a
    name the model has no place for, a shape that does not fit, or parameters the checkpoint
    never filled.
    """
    fused = list(fused)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = _expected_keys(modules, params)
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor in weights:
        if name in skipped_names or name.endswith(ignored_suffixes):
            continue
        target, part = (resolve and resolve(name)) or _resolve(name, fused)
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__} "
                f"(is the config's architecture right for this checkpoint?)"
            )
        owner_name, _, leaf = target.rpartition(".")
        owner = modules[owner_name]
        rows = owner.part_rows(part) if part is not None else None
        shard = getattr(owner, "shard_checkpoint_tensor", None)
        if shard is not None:  # tensor parallelism: this rank's piece of the full tensor
            tensor = shard(leaf, tensor, part)
        taker = getattr(owner, "load_checkpoint_part", None) if part is not None else None
        try:
            taken = taker is not None and taker(leaf, tensor, part)  # quantized experts: their method keeps the tensor
        except ValueError as error:
            raise ValueError(f"checkpoint tensor {name!r} {error} (does config.json match the weights?)") from None
        if taken:
            loaded.add((target, part))
            continue
        if isinstance(owner, Linear):
            try:
                owner.linear_method.load_checkpoint_tensor(owner, leaf, tensor, rows)
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {name!r} {error} (does config.json match the weights?)") from None
        else:
            _copy_into(name, params[target].data if rows is None else params[target].data[rows], tensor)
        loaded.add((target, part))
    missing = sorted(f"{p}[{part}]" if part else p for p, part in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"the checkpoint did not provide {len(missing)} parameters: {shown}")


def _copy_into(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"but the model expects {tuple(dest.shape)} (does config.json match the weights?)"
        )
    with torch.no_grad():
        dest.copy_(tensor)


def _resolve(name: str, fused: list[FusedProjection]) -> tuple[str, str | None]:
    # "model.layers.0.self_attn.q_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "q")
    module_path, _, leaf = name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    for projection in fused:
        if module_name == projection.checkpoint_name:
            return f"{parent}.{projection.fused_name}.{leaf}", projection.part
    return name, None


def _expected_keys(modules: dict[str, nn.Module], params: dict[str, nn.Parameter]) -> set[tuple[str, str | None]]:
    expected: set[tuple[str, str | None]] = set()
    for param_name in params:
        owner_name, _, leaf = param_name.rpartition(".")
        owner = modules[owner_name]
        if isinstance(owner, MergedLinear):
            expected.update((param_name, part) for part in owner.parts)
        elif hasattr(owner, "checkpoint_parts"):
            expected.update((param_name, part) for part in owner.checkpoint_parts(leaf))
        else:
            expected.add((param_name, None))
    return expected
