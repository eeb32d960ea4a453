"""How a linear layer's full checkpoint tensors are cut into its tensor-parallel rank's piece.

A column-parallel layer keeps its rank's output rows of every fused part (``output_shard``), a
row-parallel one its rank's slice of the input columns (``input_shard``). Quantized tensors
cover several rows or columns per entry (8 packed int4 values, a group of scales, a 128 x 128
block); a shard boundary that would fall inside one is refused (``split_error``), since the
rank could not hold its piece exactly.

The layer passed in is a ``sonar_models.layers.Linear``: it has ``parallel``, ``group``,
``prefix``, ``in_features`` (this rank's), ``local_parts`` (this rank's rows per part) and
``shards`` (each part's ``(shard index, number of shards)``).
"""

from __future__ import annotations

from typing import Any

import torch


def split_error(layer: Any, what: str, local: int, unit: int, unit_name: str) -> ValueError:
    """The refusal of a shard that would split a quantization group or block."""
    tp = layer.group.world_size
    return ValueError(
        f"{layer.prefix}: tensor_parallel_size={tp} gives each rank {local} {what}, which splits the "
        f"{unit_name} of {unit}; choose a tensor_parallel_size that keeps whole {unit_name}s on every rank "
        f"(or serve this checkpoint with tensor_parallel_size=1)"
    )


def output_shard(
    layer: Any, tensor: torch.Tensor, part: str | None, dim: int = 0, rows_per_entry: int = 1, unit_name: str = "group"
) -> torch.Tensor:
    """This rank's entries of ``tensor`` along ``dim`` for fused part ``part`` of a
    column-parallel layer, each entry covering ``rows_per_entry`` output rows (zero-padded
    where the rows do not divide, as a vocabulary).

    :raises ValueError: the rank's rows would split an entry.
    """
    index, count = layer.shards[part or ""]
    local = layer.local_parts[part or ""]
    if count == 1:
        return tensor
    if local % rows_per_entry:
        raise split_error(layer, "output rows" + (f" of part {part!r}" if part else ""), local, rows_per_entry, unit_name)
    entries = local // rows_per_entry
    needed = entries * count
    if tensor.shape[dim] < needed:
        shape = list(tensor.shape)
        shape[dim] = needed - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
    return tensor.narrow(dim, index * entries, entries)


def input_shard(layer: Any, tensor: torch.Tensor, dim: int = 1, inputs_per_entry: int = 1, unit_name: str = "group") -> torch.Tensor:
    """This rank's entries of ``tensor`` along ``dim`` for a row-parallel layer, each entry
    covering ``inputs_per_entry`` input columns.

    :raises ValueError: the rank's columns would split an entry.
    """
    local = layer.in_features
    if local % inputs_per_entry:
        raise split_error(layer, "input columns", local, inputs_per_entry, unit_name)
    entries = local // inputs_per_entry
    return tensor.narrow(dim, layer.group.rank * entries, entries)


def bias_shard(layer: Any, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
    """A bias: its rank's rows (column-parallel); whole on rank 0 and zero elsewhere
    (row-parallel: added once, after the sum)."""
    if layer.parallel == "column":
        return output_shard(layer, tensor, part)
    return tensor if layer.group.rank == 0 else torch.zeros_like(tensor)


def dense_shard(layer: Any, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
    """A floating ``weight [out, in]`` (or a ``bias [out]``) cut as ``layer.parallel`` says."""
    if tensor.dim() == 1:
        return bias_shard(layer, tensor, part)
    if layer.parallel == "column":
        return output_shard(layer, tensor, part)
    return input_shard(layer, tensor)
