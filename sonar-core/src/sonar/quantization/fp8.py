"""FP8 (E4M3) weights and activations, W8A8: the ``fp8`` method and the math every FP8 layout shares.

Three ways an FP8 model arrives, one runtime form each:

- per-output-row weight scales (``Fp8LinearMethod``): compressed-tensors checkpoints with a
  per-tensor or per-channel ``weight_scale``, and ``quantization="fp8"`` on a floating-point
  checkpoint, which quantizes each weight at load with one scale per output channel
  (``Fp8OnlineLinearMethod``; vLLM's online FP8 uses one scale per tensor, a channel scale
  loses less). Per-tensor scales are kept per output row, so a fused projection (q/k/v,
  gate/up) holds each part's own scale exactly: nothing is requantized. Activations are
  quantized per token at run time, or with the checkpoint's static ``input_scale`` (the
  largest of the fused parts' scales, which clips none of them).
- 128 x 128 block scales (``Fp8BlockLinearMethod``): the Hugging Face ``fp8`` layout, with
  ``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]`` that multiplies despite its
  name; activations quantized per token and group of 128 input features.

The products run through ``sonar.ops`` operations ``fp8_linear`` and ``fp8_block_linear``; a
platform without kernels for them runs the torch versions here, which keep the weight FP8 in
memory, dequantize it per call and quantize the activations exactly as a kernel would, so
every platform computes the same W8A8 math (exact FP8 products summed in float32).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import torch
from torch import nn

from sonar import ops
from sonar.moe import experts_by_group, fused_moe
from sonar.quantization import ExpertsMethod, LinearMethod, QuantizationMethod, UnquantizedLinearMethod, is_router
from sonar.quantization.sharding import dense_shard, input_shard, output_shard

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
MIN_AMAX = 1e-10  # an all-zero row still gets a positive scale

ops.declare_op("fp8_linear")
ops.declare_op("fp8_block_linear")
ops.declare_op("rms_norm_fp8_rows")
ops.declare_op("fused_add_rms_norm_fp8_rows")


# -- the math ----------------------------------------------------------------------------


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to the E4M3 range and rounded to FP8 (``scale`` broadcasts)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """The dynamic scale of each row of ``x`` ``[M, K]``: ``amax(|row|) / 448``, ``[M, 1]`` float32."""
    return x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX) / FP8_MAX


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale [rows] float32)`` with one scale per output row: ``W ~ q * scale[:, None]``."""
    scale = per_token_scale(weight)
    return to_fp8(weight, scale), scale[:, 0]


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` after a round trip through FP8 with a dynamic scale per row, in float32."""
    scale = per_token_scale(x)
    return to_fp8(x, scale).float() * scale


def fake_quantize_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` ``[M, K]`` after a round trip through FP8 with a dynamic scale per row and group of
    ``group`` columns (the last group may be shorter), in float32."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(m, -1, group)
    return fake_quantize_per_token(padded).view(m, -1)[:, :k]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` ``[N, K]`` times its block's entry of ``scale`` ``[ceil(N/bn), ceil(K/bk)]``, float32."""
    n, k = weight.shape
    expanded = scale.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return weight.float() * expanded


def reference_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    quantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_linear`` in torch: ``x`` quantized per token (``input_scale`` None) or with the
    static ``input_scale`` (or given as ``quantized`` with it), the FP8 product summed in
    float32, then both scales applied."""
    x2 = x.reshape(-1, x.shape[-1])
    x_scale = per_token_scale(x2) if input_scale is None else input_scale.float().reshape(-1, 1)
    q = to_fp8(x2, x_scale) if quantized is None else quantized.reshape(x2.shape)
    y = (q.float() @ weight.float().t()) * (x_scale * weight_scale.float()[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def reference_fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """``fp8_block_linear`` in torch: ``x`` quantized per token and group of ``block[1]``
    inputs, ``weight`` dequantized by its block scales, the product in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    y = fake_quantize_per_group(x2, block[1]) @ dequantize_blocks(weight, weight_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    quantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an FP8 ``weight`` ``[N, K]`` with ``weight_scale`` ``[N]``
    float32 per output row; ``x`` ``[..., K]`` quantized to FP8 per token, or with the static
    scalar ``input_scale``, or with given per-token scales ``input_scale`` ``[M, 1]`` (a
    row-parallel rank's, taken over the whole row; a platform kernel takes them too).
    ``quantized``: ``x`` already quantized with the per-token ``input_scale`` (FP8, ``x``'s
    shape; :class:`Fp8Rows`), which the product may read instead of quantizing ``x`` again.
    Returns ``x``'s dtype. A platform kernel runs it where registered."""
    impl = ops.platform_op(x, "fp8_linear")
    if impl is not None:
        if quantized is None:
            return impl(x, weight, weight_scale, input_scale, bias)
        return impl(x, weight, weight_scale, input_scale, bias, quantized)
    return reference_fp8_linear(x, weight, weight_scale, input_scale, bias, quantized)


class Fp8Rows(NamedTuple):
    """Activations already quantized per token, as ``fp8_linear`` would quantize them: ``q``
    ``[M, K]`` FP8 and ``scale`` ``[M, 1]`` float32, ``x ~ q * scale``. A norm's kernel makes
    them beside its output for the FP8 product it feeds (``LinearMethod.takes_prepared_input``)."""

    q: torch.Tensor
    scale: torch.Tensor


def rms_norm_fp8_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, Fp8Rows] | None:
    """``sonar.ops.rms_norm`` of ``x`` ``[M, K]`` with its output also quantized per token, in
    the platform's one kernel: ``(out, rows)``; None where the platform has no such kernel or
    its kernel declines the shape (run the norm alone, and the product quantizes)."""
    impl = ops.platform_op(x, "rms_norm_fp8_rows")
    made = None if impl is None or x.dim() != 2 else impl(x, weight, eps)
    if made is None:
        return None
    out, q, scale = made
    return out, Fp8Rows(q, scale)


def fused_add_rms_norm_fp8_rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows] | None:
    """``sonar.ops.fused_add_rms_norm`` (same contract: the inputs may be reused in place) with
    the normed output also quantized per token: ``(normed, residual, rows)``; None (the inputs
    untouched) where the platform has no such kernel or its kernel declines the shape."""
    impl = ops.platform_op(x, "fused_add_rms_norm_fp8_rows")
    made = None if impl is None or x.dim() != 2 else impl(x, residual, weight, eps)
    if made is None:
        return None
    normed, residual, q, scale = made
    return normed, residual, Fp8Rows(q, scale)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an FP8 ``weight`` ``[N, K]`` with one scale per ``block``
    (``weight_scale`` ``[ceil(N/bn), ceil(K/bk)]``), ``x`` quantized per token and group of
    ``block[1]``. A platform kernel runs it where registered."""
    impl = ops.platform_op(x, "fp8_block_linear")
    if impl is not None:
        return impl(x, weight, weight_scale, block, bias)
    return reference_fp8_block_linear(x, weight, weight_scale, block, bias)


# -- linear methods ----------------------------------------------------------------------


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _check_fp8(tensor: torch.Tensor) -> None:
    if tensor.dtype != FP8_DTYPE:
        raise ValueError(f"is {tensor.dtype}, but this FP8 layout stores weights as {FP8_DTYPE}")


class Fp8LinearMethod(LinearMethod):
    """``weight`` FP8 ``[out, in]``, ``weight_scale`` float32 ``[out]`` (a checkpoint's per-tensor
    ``[1]`` fills the rows of its part, a per-channel ``[out, 1]`` its own rows), ``input_scale``
    float32 scalar where activations are static, optional ``bias``."""

    supports_tensor_parallel = True

    def __init__(self, static_activations: bool = False) -> None:
        self.static_activations = static_activations

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        layer.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        layer.weight_scale = _frozen(torch.ones(out_features, dtype=torch.float32))
        layer.input_scale = _frozen(torch.zeros((), dtype=torch.float32)) if self.static_activations else None
        layer.bias = _frozen(torch.zeros(out_features, dtype=dtype)) if bias else None

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: slice | None) -> None:
        if param_name == "weight":
            _check_fp8(tensor)
        elif param_name == "weight_scale":
            dest = layer.weight_scale.data if rows is None else layer.weight_scale.data[rows]
            if tensor.numel() != 1 and tuple(tensor.shape) not in ((dest.numel(),), (dest.numel(), 1)):
                raise ValueError(f"has shape {tuple(tensor.shape)}, but a per-tensor [1] or per-channel [{dest.numel()}, 1] scale fits")
            dest.copy_(tensor.float().reshape(-1).expand(dest.numel()))
            return
        elif param_name == "input_scale":
            if layer.input_scale is None or tensor.numel() != 1:
                raise ValueError("is a static activation scale, but the scheme quantizes activations per token" if layer.input_scale is None else f"has shape {tuple(tensor.shape)}, but a per-tensor [1] scale fits")
            layer.input_scale.data = torch.maximum(layer.input_scale.data, tensor.float().reshape(()).to(layer.input_scale.device))
            return
        super().load_checkpoint_tensor(layer, param_name, tensor, rows)

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
        """Weights and biases as floating ones; a per-channel ``weight_scale`` follows the output
        rows (whole on a row-parallel rank); per-tensor and input scales are whole everywhere."""
        if param_name in ("weight", "bias"):
            return dense_shard(layer, param_name, tensor, part)
        if param_name == "weight_scale" and tensor.numel() != 1 and layer.parallel == "column":
            return output_shard(layer, tensor, part)
        return tensor

    def takes_prepared_input(self, layer: nn.Module) -> str | None:
        """FP8 rows where activations are quantized per token over the layer's whole input
        (dynamic scales; not a row-parallel rank's slice, whose scale spans the ranks)."""
        if layer.input_scale is None and getattr(layer, "parallel", "replicated") != "row":
            return "fp8_rows"
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, prepared: Any = None) -> torch.Tensor:
        if isinstance(prepared, Fp8Rows):
            return fp8_linear(x, layer.weight, layer.weight_scale, prepared.scale, layer.bias, prepared.q)
        input_scale = layer.input_scale
        if input_scale is None and getattr(layer, "parallel", "replicated") == "row":
            # each token's scale over its whole row, as on one device: the largest of the ranks' slices
            local = per_token_scale(x.reshape(-1, x.shape[-1]))  # [M, 1]
            input_scale = layer.group.communicator.all_gather(local, dim=-1).amax(dim=-1, keepdim=True)
        return fp8_linear(x, layer.weight, layer.weight_scale, input_scale, layer.bias)


class _QuantizedRows(NamedTuple):
    """A rank's piece of a weight quantized whole (``Fp8OnlineLinearMethod`` under tensor
    parallelism): FP8 ``weight`` and its rows' ``scale``, computed over the full rows."""

    weight: torch.Tensor
    scale: torch.Tensor


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    """A floating-point checkpoint's ``weight`` quantized at load to FP8 with one scale per
    output row (a buffer, so the checkpoint need not carry it); activations per token."""

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().create_weights(layer, in_features, output_sizes, bias, dtype)
        del layer.weight_scale
        layer.register_buffer("weight_scale", torch.ones(sum(output_sizes), dtype=torch.float32))

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, part: str | None) -> Any:
        """The weight is quantized whole first (a row's scale is its full row's, as on one
        device), then cut: its rows' FP8 values and scales, or its slice of the columns
        with the whole rows' scales."""
        if param_name != "weight":
            return super().shard_checkpoint_tensor(layer, param_name, tensor, part)
        quantized, scale = quantize_per_row(tensor.to(layer.weight.device))
        if layer.parallel == "column":
            return _QuantizedRows(output_shard(layer, quantized.view(torch.uint8), part).view(FP8_DTYPE), output_shard(layer, scale, part))
        return _QuantizedRows(input_shard(layer, quantized.view(torch.uint8)).view(FP8_DTYPE), scale)

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: Any, rows: slice | None) -> None:
        if param_name != "weight":
            return super().load_checkpoint_tensor(layer, param_name, tensor, rows)
        dest = layer.weight.data if rows is None else layer.weight.data[rows]
        shape = tuple((tensor.weight if isinstance(tensor, _QuantizedRows) else tensor).shape)
        if tuple(dest.shape) != shape:
            raise ValueError(f"has shape {shape}, but the model expects {tuple(dest.shape)}")
        quantized, scale = tensor if isinstance(tensor, _QuantizedRows) else quantize_per_row(tensor.to(dest.device))
        dest.copy_(quantized)
        (layer.weight_scale if rows is None else layer.weight_scale[rows]).copy_(scale)


class Fp8BlockLinearMethod(LinearMethod):
    """``weight`` FP8 ``[out, in]`` and ``weight_scale_inv`` float32 ``[ceil(out/bn), ceil(in/bk)]``
    (the Hugging Face ``fp8`` layout); a fused part must start on a block boundary."""

    supports_tensor_parallel = True

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        scale_shape = (math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1]))
        layer.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        layer.weight_scale_inv = _frozen(torch.ones(scale_shape, dtype=torch.float32))
        layer.bias = _frozen(torch.zeros(out_features, dtype=dtype)) if bias else None

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: slice | None) -> None:
        if param_name == "weight":
            _check_fp8(tensor)
        if param_name == "weight_scale_inv" and rows is not None:
            if rows.start % self.block[0]:
                raise ValueError(f"fills rows from {rows.start}, which is not a multiple of the block size {self.block[0]}")
            rows = slice(rows.start // self.block[0], math.ceil(rows.stop / self.block[0]))
        super().load_checkpoint_tensor(layer, param_name, tensor.float() if param_name == "weight_scale_inv" else tensor, rows)

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
        """Weights as floating ones; ``weight_scale_inv`` by whole blocks (a rank's rows or
        columns that would split a block are refused)."""
        if param_name != "weight_scale_inv":
            if param_name == "weight":  # FP8 has no zeros to pad with: cut its bytes
                return dense_shard(layer, param_name, tensor.view(torch.uint8), part).view(tensor.dtype)
            return dense_shard(layer, param_name, tensor, part)
        if layer.parallel == "column":
            return output_shard(layer, tensor, part, dim=0, rows_per_entry=self.block[0], unit_name="FP8 scale block")
        return input_shard(layer, tensor, dim=1, inputs_per_entry=self.block[1], unit_name="FP8 scale block")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block, layer.bias)


# -- experts ------------------------------------------------------------------------------


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 ``weight [out, in]`` times its scale (per tensor ``[1]``, per output channel
    ``[out]`` / ``[out, 1]``, or ``block`` scales), in ``dtype``."""
    if block is not None:
        return dequantize_blocks(weight, scale, block).to(dtype)
    scale = scale.float()
    return (weight.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))).to(dtype)


class Fp8ExpertsMethod(ExpertsMethod):
    """A mixture-of-experts layer's experts from an FP8 checkpoint: each projection's
    float8_e4m3fn ``weight`` with its ``weight_scale`` (per tensor or per output channel) or
    ``weight_scale_inv`` (``block`` scales). A static ``input_scale`` is read and not used: the
    experts run with unquantized activations (W8A16).

    On the CPU the weights stay FP8 in memory and each expert's are dequantized per call, over
    the tokens routed to it. On a platform with a ``fused_moe_fp8`` kernel (CUDA) the experts
    stay FP8, stacked once the last expert has arrived: per-tensor and per-channel ones with a
    scale per output row, block-scaled ones with their blocks' scales (blocks of inputs a
    multiple of 16, the kernel's smallest tile). Any other, and any on a platform without that
    kernel, are dequantized then into the stacked floating weights of ``fused_moe``."""

    def __init__(self, block: tuple[int, int] | None = None, static_activations: bool = False) -> None:
        self.block = block
        scale = "weight_scale_inv" if block is not None else "weight_scale"
        self.checkpoint_tensors = ("weight", scale, *(("input_scale",) if static_activations else ()))
        self._scale = scale

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        self.hold_whole_experts(layer, "an FP8 checkpoint's experts", FP8_DTYPE)
        layer.fp8_dtype = torch.get_default_dtype()
        layer.fp8_sizes = (hidden_size, intermediate_size)
        layer.fp8_parts = {}
        layer.fp8_experts = [None] * num_experts

    def load_checkpoint_part(self, layer: nn.Module, leaf: str, tensor: Any, part: tuple[int, str, str]) -> None:
        expert, name, kind = part
        if kind == "input_scale":
            return
        hidden, intermediate = layer.fp8_sizes
        rows, cols = (hidden, intermediate) if name == "down" else (intermediate, hidden)
        if kind == "weight":
            _check_fp8(tensor)
            if tuple(tensor.shape) != (rows, cols):
                raise ValueError(f"has shape {tuple(tensor.shape)}, but expert {expert}'s {name} projection is {(rows, cols)}")
        elif self.block is not None:
            expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if tuple(tensor.shape) != expected:
                raise ValueError(f"has shape {tuple(tensor.shape)}, but {self.block} blocks of a {(rows, cols)} weight need {expected}")
        elif tensor.numel() != 1 and tuple(tensor.shape) not in ((rows,), (rows, 1)):
            raise ValueError(f"has shape {tuple(tensor.shape)}, but a per-tensor [1] or per-channel [{rows}, 1] scale fits")
        layer.fp8_parts[(expert, name, kind)] = tensor
        keys = [(expert, n, k) for n in ("gate", "up", "down") for k in ("weight", self._scale)]
        if not all(key in layer.fp8_parts for key in keys):
            return
        weights = [(layer.fp8_parts.pop((expert, n, "weight")), layer.fp8_parts.pop((expert, n, self._scale))) for n in ("gate", "up", "down")]
        device = layer.w13.device
        layer.fp8_experts[expert] = [(w.to(device), s.to(device)) for w, s in weights]
        if device.type != "cpu" and all(e is not None for e in layer.fp8_experts):
            kernel = ops.platform_op(torch.empty(0, device=device), "fused_moe_fp8")
            if kernel is not None and (self.block is None or self.block[1] % 16 == 0):
                self._stack(layer, kernel)
            else:
                self._dequantize(layer)

    def _stack(self, layer: nn.Module, kernel: Any) -> None:
        """Every expert's FP8 weights stacked as the platform's ``fused_moe_fp8`` takes them,
        with one float32 scale per output row (a per-tensor scale repeated), or their blocks'
        scales (the gate's block rows, then the up's)."""
        def rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            if self.block is not None:
                return scale.float()
            return scale.float().reshape(-1).expand(weight.shape[0]) if scale.numel() == 1 else scale.float().reshape(-1)

        experts = layer.fp8_experts
        layer.w13 = _frozen(torch.stack([torch.cat([gate[0], up[0]]) for gate, up, _ in experts]))
        layer.w2 = _frozen(torch.stack([down[0] for _, _, down in experts]))
        layer.w13_scale = _frozen(torch.stack([torch.cat([rows(*gate), rows(*up)]) for gate, up, _ in experts]))
        layer.w2_scale = _frozen(torch.stack([rows(*down) for _, _, down in experts]))
        layer.fp8_kernel = kernel
        layer.fp8_experts = None

    def _floating(self, layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_weight(weight, scale, self.block, layer.fp8_dtype)

    def _dequantize(self, layer: nn.Module) -> None:
        """Every expert as the stacked floating tensors of ``fused_moe`` (the FP8 ones dropped)."""
        w13 = torch.stack([torch.cat([self._floating(layer, *gate), self._floating(layer, *up)]) for gate, up, _ in layer.fp8_experts])
        w2 = torch.stack([self._floating(layer, *down) for _, _, down in layer.fp8_experts])
        layer.w13, layer.w2 = _frozen(w13), _frozen(w2)
        layer.fp8_experts = None

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.fp8_experts is None:
            kernel = getattr(layer, "fp8_kernel", None)
            if kernel is not None:
                blocks = {} if self.block is None else {"block": self.block}
                return kernel(x, layer.w13, layer.w2, layer.w13_scale, layer.w2_scale, topk_weights, topk_ids, expert_map=layer.expert_map, **blocks)
            return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.expert_map)

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up, down = (self._floating(layer, w, s).to(rows.dtype) for w, s in layer.fp8_experts[expert])
            h = torch.nn.functional.silu(torch.nn.functional.linear(rows, gate)) * torch.nn.functional.linear(rows, up)
            return torch.nn.functional.linear(h, down)

        return experts_by_group(x, topk_weights, topk_ids, layer.expert_map, len(layer.fp8_experts), expert_mlp)


class Fp8OnlineExpertsMethod(Fp8ExpertsMethod):
    """A floating-point checkpoint's experts quantized at load (``quantization="fp8"``): each
    projection's ``weight`` to FP8 with one scale per output row, then held and run as
    :class:`Fp8ExpertsMethod` holds and runs a checkpoint's per-channel experts."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_tensors = ("weight",)

    def load_checkpoint_part(self, layer: nn.Module, leaf: str, tensor: Any, part: tuple[int, str, str]) -> None:
        expert, name, _ = part
        if not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
            raise ValueError(f"is {tensor.dtype}, but quantization='fp8' quantizes floating-point experts at load")
        quantized, scale = quantize_per_row(tensor.to(layer.w13.device))
        super().load_checkpoint_part(layer, leaf, quantized, (expert, name, "weight"))
        super().load_checkpoint_part(layer, leaf, scale, (expert, name, "weight_scale"))


# -- which layers stay in floating point -----------------------------------------------

_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_names(layer_prefix: str) -> list[str]:
    # a fused layer is named after its parts in the checkpoint's ignore lists
    parent, _, leaf = layer_prefix.rpartition(".")
    parts = _FUSED_PARTS.get(leaf)
    return [f"{parent}.{part}" if parent else part for part in parts] if parts else [layer_prefix]


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def is_ignored(layer_prefix: str, ignore: list[str]) -> bool:
    """Whether the checkpoint left the layer at ``layer_prefix`` unquantized (``lm_head`` and
    mixture-of-experts routers always are): ``ignore`` holds module names, dotted suffixes of them, or ``re:`` patterns.

    :raises ValueError: some parts of a fused layer are ignored and others not.
    """
    if layer_prefix in ("", "lm_head") or is_router(layer_prefix):
        return True
    names = _checkpoint_names(layer_prefix)
    ignored = [any(_matches(name, pattern) for pattern in ignore) for name in names]
    if any(ignored) and not all(ignored):
        raise ValueError(f"the checkpoint quantizes only some of {names}, which Sonar runs as one fused layer {layer_prefix!r}")
    return all(ignored)


class Fp8Method(QuantizationMethod):
    """``fp8``: the Hugging Face FP8 layout (``weight_block_size`` block scales, or per-tensor
    ``weight_scale`` with ``activation_scheme`` static or dynamic), or, forced on a checkpoint
    without a ``quantization_config``, FP8 weights quantized at load (per output channel,
    dynamic per-token activations). ``lm_head`` and ``modules_to_not_convert`` stay unquantized."""

    name = "fp8"
    platforms = ("cpu", "cuda")
    reads = "HF fp8: float8_e4m3fn weight + weight_scale_inv 128x128 blocks (or per-tensor weight_scale); bf16/fp16 checkpoints quantized at load (per channel)"
    execution = {
        "cpu": "FP8 in memory, dequantized per call; activations quantized as on the GPU; a mixture-of-experts layer's "
        "experts FP8 in memory, each dequantized per call over its tokens (activations unquantized)",
        "cuda": "per channel: fused Triton GEMV for one row, torch._scaled_mm row-wise otherwise; blocks: dequantized per call; "
        "a mixture-of-experts layer's experts FP8 in the fused Triton MoE kernel (W8A16): per tensor or channel, a scale per output row; blocks, each weight tile times its block's scale as it is read",
    }
    tested_by = {"cpu": "tests/test_quant_fp8.py", "cuda": "tests/test_quant_cuda.py"}

    def __init__(self, serialized: bool, block: tuple[int, int] | None, static_activations: bool, ignore: list[str]) -> None:
        self.serialized = serialized
        self.block = block
        self.static_activations = static_activations
        self.ignore = ignore

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Fp8Method:
        serialized = quant_config.get("quant_method") == "fp8"
        block = quant_config.get("weight_block_size")
        scheme = quant_config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported; supported: 'dynamic', 'static'")
        if block is not None and (len(block) != 2 or scheme != "dynamic"):
            raise ValueError(f"fp8 weight_block_size {block} with activation_scheme {scheme!r} is not supported; supported: [bn, bk] with 'dynamic'")
        return cls(serialized, tuple(block) if block else None, serialized and scheme == "static", list(quant_config.get("modules_to_not_convert") or []))

    def experts_method(self, layer_prefix: str) -> ExpertsMethod | None:
        """FP8 experts: as the checkpoint stores them, or, for a floating-point checkpoint,
        quantized at load per output row (floating where tensor parallelism splits them)."""
        if any(_matches(f"{layer_prefix}.0.gate_proj", p) for p in self.ignore):
            return None
        if not self.serialized:
            from sonar.distributed import current_group

            group = current_group()
            # experts split over tensor-parallel ranks stay floating, as before (FP8 experts are held whole)
            return None if group.world_size > 1 and not group.expert_parallel else Fp8OnlineExpertsMethod()
        return Fp8ExpertsMethod(self.block, self.static_activations)

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        if is_ignored(layer_prefix, self.ignore):
            return UnquantizedLinearMethod()
        if not self.serialized:
            return Fp8OnlineLinearMethod()
        if self.block is not None:
            return Fp8BlockLinearMethod(self.block)
        return Fp8LinearMethod(static_activations=self.static_activations)
