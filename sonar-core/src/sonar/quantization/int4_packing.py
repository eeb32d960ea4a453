"""The runtime layout GPTQ and AWQ int4 weights share, and the linear method that runs it.

Both formats are repacked at load into one layout, so one kernel per platform serves both:

- ``qweight`` int32 ``[out, in / 8]``: word ``j`` of row ``n`` holds ``q[n, 8j + i]`` in bits
  ``4i .. 4i + 3`` (unsigned 4-bit values, the input dim packed, each output row contiguous);
- ``scales`` ``[groups, out]`` in the model's dtype;
- ``qzeros`` ``[groups, out]`` in the model's dtype: each group's zero point as a number, an
  integer 0..16 as both formats store them (a platform kernel may rely on that: CUDA's
  subtracts it from the nibbles in 16-bit arithmetic, exact only for integers);
- ``W[n, k] = (q[n, k] - qzeros[k // group_size, n]) * scales[k // group_size, n]``.

A GPTQ checkpoint quantized in activation order (``desc_act``) has its input dim permuted at
load so that groups are contiguous; the layer then keeps ``input_order`` and the product reads
``x[..., input_order]``.

Platforms give a kernel for the operation ``"int4_linear"`` (signature of :func:`int4_linear`);
elsewhere the weight is dequantized per call and run through ``sonar.ops.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from sonar import ops
from sonar.quantization import LinearMethod
from sonar.quantization.sharding import split_error

ops.declare_op("int4_linear")

PACK_FACTOR = 8  # 4-bit values per int32
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The 4-bit values of int32 ``packed``, 8 per word along ``dim`` (``dim`` grows 8x), as
    int32. ``order[j]`` is the nibble that holds the word's ``j``-th value (None: nibble ``j``)."""
    dim = dim % packed.dim()
    nibbles = (packed.unsqueeze(dim + 1) >> SHIFTS.to(packed.device).view([8 if d == dim + 1 else 1 for d in range(packed.dim() + 1)])) & 0xF
    if order is not None:
        nibbles = nibbles.index_select(dim + 1, torch.tensor(order, device=packed.device))
    return nibbles.flatten(dim, dim + 1)


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Integer ``values`` in 0..15 packed 8 per int32 along ``dim`` (``dim`` shrinks 8x); the
    inverse of :func:`unpack_int4` with the same ``order``."""
    dim = dim % values.dim()
    shape = list(values.shape)
    if shape[dim] % PACK_FACTOR:
        raise ValueError(f"cannot pack {shape[dim]} values 8 to a word")
    grouped = values.to(torch.int64).unflatten(dim, (shape[dim] // PACK_FACTOR, PACK_FACTOR))
    if order is not None:
        inverse = [0] * PACK_FACTOR
        for j, nibble in enumerate(order):
            inverse[nibble] = j
        grouped = grouped.index_select(dim + 1, torch.tensor(inverse, device=values.device))
    # nibbles do not overlap, so their sum is their bitwise or (in int64: bit 31 is the sign of an int32)
    total = (grouped << SHIFTS.to(values.device, torch.int64).view([8 if d == dim + 1 else 1 for d in range(grouped.dim())])).sum(dim + 1)
    return torch.where(total >= 2**31, total - 2**32, total).to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 ``[out, in]`` weight of the runtime layout."""
    q = unpack_int4(qweight, dim=1).float()  # [out, in]
    scale = scales.float().t().repeat_interleave(group_size, dim=1)
    zero = qzeros.float().t().repeat_interleave(group_size, dim=1)
    return (q - zero) * scale


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for the runtime layout's ``W`` (``x`` ``[..., in]``, returned in
    ``x``'s dtype), reading ``x[..., input_order]`` where the layer is in activation order.

    The platform's ``"int4_linear"`` kernel where one is registered; else ``W`` is dequantized
    for this call and the product runs through ``sonar.ops.linear``.
    """
    impl = ops.platform_op(x, "int4_linear")
    if impl is not None:
        return impl(x, qweight, scales, qzeros, group_size, input_order, bias)
    if input_order is not None:
        x = x.index_select(-1, input_order)
    weight = dequantize_int4(qweight, scales, qzeros, group_size).to(x.dtype)
    return ops.linear(x, weight, bias)


def int4_linear_by_group(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_index: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` where input ``k`` belongs to group ``group_index[k]`` of
    ``scales``/``qzeros`` ``[groups, out]``, in any order and any number per group:
    ``W[n, k] = (q[n, k] - qzeros[g, n]) * scales[g, n]`` with ``g = group_index[k]``.

    A row-parallel rank of a GPTQ checkpoint in activation order holds such inputs (its slice
    of the columns draws on every group). Dequantized per call on every platform."""
    q = unpack_int4(qweight, dim=1).float()  # [out, in]
    weight = (q - qzeros.float()[group_index].t()) * scales.float()[group_index].t()
    return ops.linear(x, weight.to(x.dtype), bias)


class Int4LinearMethod(LinearMethod):
    """A linear layer in the shared int4 runtime layout; a format's subclass turns its
    checkpoint tensors into it in ``load_checkpoint_tensor``.

    ``group_size`` is the format's (-1: one group per output channel).
    """

    format_name = "int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        group_size = in_features if self.group_size == -1 else self.group_size
        where = f"{self.format_name} layer {layer.prefix or '(unnamed)'}"
        parallel = getattr(layer, "parallel", "replicated")
        if parallel == "row" and in_features % group_size:
            raise split_error(layer, "input columns", in_features, group_size, f"{self.format_name} group")
        if in_features % group_size or group_size % PACK_FACTOR:
            raise ValueError(f"{where}: {in_features} inputs do not split into groups of {group_size} (multiples of 8)")
        for size in output_sizes:
            if size % PACK_FACTOR and parallel == "column":
                raise split_error(layer, "output rows", size, PACK_FACTOR, "packed int4 word")
            if size % PACK_FACTOR:
                raise ValueError(f"{where}: {size} outputs are not a multiple of 8, as 4-bit packing needs")
        num_groups = in_features // group_size
        layer.group_size = group_size
        layer.qweight = _frozen(torch.zeros(out_features, in_features // PACK_FACTOR, dtype=torch.int32))
        layer.scales = _frozen(torch.zeros(num_groups, out_features, dtype=dtype))
        layer.qzeros = _frozen(torch.zeros(num_groups, out_features, dtype=dtype))
        layer.bias = _frozen(torch.zeros(out_features, dtype=dtype)) if bias else None
        layer.register_buffer("input_order", torch.arange(in_features), persistent=False)
        layer.act_order = False
        # each input's group where a rank's inputs do not form whole groups (see int4_linear_by_group)
        layer.register_buffer("group_index", None, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.group_index is not None:
            return int4_linear_by_group(x, layer.qweight, layer.scales, layer.qzeros, layer.group_index, layer.bias)
        input_order = layer.input_order if layer.act_order else None
        return int4_linear(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, input_order, layer.bias)

    # -- helpers for a format's load_checkpoint_tensor -------------------------------------

    @staticmethod
    def store(layer: nn.Module, name: str, value: torch.Tensor, rows: slice | None, out_dim: int) -> None:
        """Copy runtime-layout ``value`` into parameter ``name``, at output rows ``rows`` of its
        dimension ``out_dim`` (None: all of it).

        :raises ValueError: the shape does not fit.
        """
        param = getattr(layer, name)
        dest = param.data if rows is None else param.data.narrow(out_dim, rows.start, rows.stop - rows.start)
        if tuple(dest.shape) != tuple(value.shape):
            raise ValueError(f"becomes {tuple(value.shape)} in the runtime layout, but the layer holds {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(value)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
