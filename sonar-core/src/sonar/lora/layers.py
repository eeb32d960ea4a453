"""The per-slot adapter weights every linear layer of a LoRA-enabled model holds.

``attach_lora(model, ...)`` gives each linear layer (every module whose class declares a
``lora`` attribute and that has ``in_features``, ``out_features`` and a checkpoint ``prefix``;
``sonar_models.layers.Linear`` does) a :class:`LoRALinear`: its stacked A and B of
``max_loras`` slots, rank padded to ``max_lora_rank``. The layer calls ``lora.apply(self,
x)``: its ``LinearMethod`` computes the base output (quantized or not) and the adapters'
products are added for the tokens of adapter requests; in a step where no request has one,
only the base product runs. Where the platform can, the shrink runs in the base product's
launch (an unquantized layer at one row) or beside it on a second stream.

A fused layer (q/k/v, gate/up) holds one A block per part (``a [S, P * R, in]``) and one B over
all its output rows; an adapter that targets some parts only (q and v, say) leaves the
others zero.

Under tensor parallelism every rank reads the whole adapter and keeps its piece, cut the way
the base layer is (``LoRASite.cut``): on a column-parallel layer A whole and B's rows of the
rank's output rows, per fused part; on a row-parallel one A's columns of the rank's inputs
and B whole. A row-parallel layer's shrink results (``[T, P * R]``) are summed over the ranks
by one all-reduce, and rank 0 alone expands them into its partial output, so the delta is in
the layer's all-reduced output exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sonar.distributed import ParallelGroup
from sonar.lora import ops as lora_ops
from sonar.lora.adapter import LoRATarget
from sonar.quantization import UnquantizedLinearMethod
from sonar.tensors import to_device

EXCLUDED_LEAVES = frozenset({"lm_head"})  # LoRA on the output head is not supported


class LoRABatch:
    """One step's adapters, shared by every layer: ``token_slots`` is a persistent buffer
    (captured CUDA graphs keep reading it) of each token's slot, -1 for none; ``active`` is
    False in a step without any adapter request, and then no layer runs any LoRA work."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.active = False
        self.capturing = False  # a CUDA graph is being captured: every layer runs its LoRA path
        self.device = device
        self._num_written = 0  # tokens from 0 that may hold a slot; the rest hold -1

    @property
    def max_tokens(self) -> int:
        return self.token_slots.shape[0]

    def set(self, slots: np.ndarray) -> None:
        """This step's slot per token (int32 ``[T]``); the rows after ``T`` (graph padding)
        become -1."""
        count = len(slots)
        if count > self.max_tokens:
            raise ValueError(f"a step of {count} tokens exceeds the LoRA slot buffer of {self.max_tokens}")
        self.token_slots[:count].copy_(to_device(slots.astype(np.int32, copy=False), self.device), non_blocking=True)
        if self._num_written > count:
            self.token_slots[count : self._num_written].fill_(-1)
        self._num_written = count
        self.active = True

    def deactivate(self) -> None:
        self.active = False


class LoRALinear:
    """The adapter slots of one linear layer (not a module: it adds no parameters or state-dict
    names to the base model).

    :param part_sizes: output rows of each fused part, in order (one part when unfused).
    """

    def __init__(
        self, in_features: int, part_sizes: list[int], batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
        row_group: ParallelGroup | None = None,
    ) -> None:
        self.batch = batch
        self.row_group = row_group  # a row-parallel base layer's group: shrink results summed over it
        self.max_rank = max_rank
        device = batch.device
        self.a = torch.zeros(max_loras, len(part_sizes) * max_rank, in_features, dtype=dtype, device=device)  # [S, P*R, in]
        self.b = torch.zeros(max_loras, sum(part_sizes), max_rank, dtype=dtype, device=device)  # [S, out, R]
        starts = np.cumsum([0, *part_sizes])
        self.part_rows = tuple((int(starts[i]), int(starts[i + 1])) for i in range(len(part_sizes)))
        self.filled: set[int] = set()  # slots an adapter targeting this layer fills

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer``'s output for ``x``: its ``LinearMethod``'s base product plus each token's
        adapter delta (only the product where no adapter in a slot targets this layer, except
        while a graph that later adapters will replay is captured). An unquantized layer lets
        the platform compute the product and the shrink in one launch
        (``lora_ops.lora_linear_shrink``); otherwise the shrink starts beside the product where
        the platform can (``lora_ops.lora_shrink_begin``) and the delta is added after it."""
        method = layer.linear_method
        batch = self.batch
        if not batch.active or not (self.filled or batch.capturing):
            return method.apply(layer, x)
        slots = batch.token_slots[: x.shape[0]]
        group = self.row_group
        if group is not None:  # each rank shrinks its slice of the inputs; the sum expands once
            out = method.apply(layer, x)
            summed = group.communicator.all_reduce(lora_ops.lora_shrink(x, self.a, slots))
            return lora_ops.lora_expand(summed, self.b, slots, out, self.part_rows) if group.rank == 0 else out
        if type(method) is UnquantizedLinearMethod:
            both = lora_ops.lora_linear_shrink(x, layer.weight, layer.bias, self.a, slots)
            if both is not None:
                out, shrunk = both
                return lora_ops.lora_expand(shrunk, self.b, slots, out, self.part_rows)
        join = lora_ops.lora_shrink_begin(x, self.a, slots)
        out = method.apply(layer, x)
        if join is not None:
            return lora_ops.lora_expand(join(), self.b, slots, out, self.part_rows)
        # shrink then expand; a platform fuses them into one launch where the tokens are few
        return lora_ops.lora_shrink_expand(x, self.a, self.b, slots, out, self.part_rows)

    def clear_slot(self, slot: int) -> None:
        if slot in self.filled:  # the others are zero already
            self.a[slot].zero_()
            self.b[slot].zero_()
        self.filled.discard(slot)

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Fill part ``part`` of ``slot`` with ``a [r, in]`` and ``b [rows of part, r]`` (the
        rest of the slot's rank stays zero: call ``clear_slot`` first)."""
        rank = a.shape[0]
        r0, r1 = self.part_rows[part]
        start = part * self.max_rank
        self.a[slot, start : start + rank].copy_(a, non_blocking=True)
        self.b[slot, r0:r1, :rank].copy_(b, non_blocking=True)
        self.filled.add(slot)


@dataclass(frozen=True, slots=True)
class LoRASite:
    """Where one checkpoint module's adapter goes: part ``part`` of ``layer``. ``target`` has
    the module's full sizes (what an adapter's files hold); a tensor-parallel rank keeps
    ``b_rows`` of B (column-parallel) or ``a_columns`` of A (row-parallel), None: all."""

    layer: LoRALinear
    part: int
    target: LoRATarget
    b_rows: tuple[int, int] | None = None
    a_columns: tuple[int, int] | None = None

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's piece of a module's ``a [r, in]`` and ``b [out, r]``."""
        if self.a_columns is not None:
            a = a[:, self.a_columns[0] : self.a_columns[1]]
        if self.b_rows is not None:
            b = b[self.b_rows[0] : self.b_rows[1]]
        return a, b


def attach_lora(model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype) -> dict[str, LoRASite]:
    """Give every linear layer of ``model`` (``lm_head`` aside) its adapter slots; returns
    each checkpoint module name (``model.layers.0.self_attn.q_proj``) an adapter may target.

    Fused layers are mapped back to their checkpoint modules through the model's
    ``fused_projections`` (``(checkpoint_name, fused_name, part)`` entries)."""
    fused = {(f.fused_name, f.part): f.checkpoint_name for f in getattr(model, "fused_projections", ())}
    sites: dict[str, LoRASite] = {}
    for module in model.modules():
        if not hasattr(type(module), "lora") or not getattr(module, "prefix", ""):
            continue
        prefix: str = module.prefix
        parent, _, leaf = prefix.rpartition(".")
        if leaf in EXCLUDED_LEAVES:
            continue
        parts: dict[str, int] = dict(getattr(module, "parts", None) or {leaf: module.out_features})
        parallel = getattr(module, "parallel", "replicated")
        group = getattr(module, "group", None)
        row_group = group if parallel == "row" else None
        layer = LoRALinear(module.in_features, list(parts.values()), batch, max_loras, max_rank, dtype, row_group)
        for index, (part, size) in enumerate(parts.items()):
            name = prefix if len(parts) == 1 and part == leaf else fused.get((leaf, part))
            if name is None:
                raise ValueError(f"{prefix}: the model names no checkpoint module for fused part {part!r} (fused_projections)")
            if name != prefix:
                name = f"{parent}.{name}" if parent else name
            in_features, out_features, b_rows, a_columns = module.in_features, size, None, None
            if parallel == "column":  # this rank's rows of the part (its shard of it)
                shard_key = part if len(parts) > 1 or part != leaf else ""
                shard_index, _ = module.shards[shard_key]
                out_features = module.checkpoint_sizes[shard_key]
                b_rows = (shard_index * size, shard_index * size + size)
            elif parallel == "row":  # this rank's slice of the inputs
                in_features = module.in_features * group.world_size
                a_columns = (group.rank * module.in_features, (group.rank + 1) * module.in_features)
            sites[name] = LoRASite(layer, index, LoRATarget(name, in_features, out_features), b_rows, a_columns)
        module.lora = layer
    return sites
