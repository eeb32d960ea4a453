"""This platform's kernels behind ``sonar.ops`` (named by ``CudaPlatform.ops_module``).

Models call ``sonar.ops``; for CUDA tensors those calls land here. The norms, rotary and
activation run as single Triton launches; the fused add + norm and the rotary work in place.
Products of one row of activations (decode at batch 1) and argmaxes over the vocabulary run
as Triton kernels; other products go to the library. The LoRA shrink and expand of batches
that mix adapters are Triton kernels (``sonar_cuda.kernels.lora``); at decode sizes the
shrink runs on a side stream while the base layer's product does, and at batch 1 in the
matrix-vector product's own launch; the experts of a mixture-of-experts layer run as two
grouped GEMMs over tokens sorted by expert (``sonar_cuda.kernels.fused_moe``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import sonar.lora.ops  # noqa: F401  (declares "lora_shrink", "lora_expand" and "lora_shrink_expand")
import sonar.moe  # noqa: F401  (declares "fused_moe")
import sonar.quantization.int4_packing  # noqa: F401  (declares "int4_linear")
from sonar_cuda.kernels.activation import silu_and_mul as _silu_and_mul
from sonar_cuda.kernels.argmax import argmax as _argmax
from sonar_cuda.kernels.fp8_linear import fp8_linear
from sonar_cuda.kernels.fused_moe import fused_moe, fused_moe_fp8
from sonar_cuda.kernels.gemv import gemv, gemv_pays, gemv_supported, gemv_with_shrink
from sonar_cuda.kernels.int4_gemm import int4_linear
from sonar_cuda.kernels.layernorm import fused_add_rms_norm as _fused_add_rms_norm
from sonar_cuda.kernels.layernorm import fused_add_rms_norm_fp8 as _fused_add_rms_norm_fp8
from sonar_cuda.kernels.layernorm import rms_norm as _rms_norm
from sonar_cuda.kernels.layernorm import rms_norm_fp8 as _rms_norm_fp8
from sonar_cuda.kernels.lora import lora_expand, lora_shrink, lora_shrink_begin, lora_shrink_expand
from sonar_cuda.kernels.rotary import rotary_embedding


def lora_linear_shrink(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One row where the Triton matrix-vector product serves it: the product and the adapter's
    shrink in its one launch; anything else: None (the two run apart)."""
    if not (gemv_supported(x, weight, bias) and gemv_pays(weight)):
        return None
    if a.dim() != 3 or a.shape[2] != weight.shape[1] or a.dtype != weight.dtype or a.stride(2) != 1 or a.device != x.device:
        return None
    return gemv_with_shrink(x, weight, bias, a, token_slots)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One row of ``x`` (where the weight's shape suits it): the Triton matrix-vector product;
    anything else: the library."""
    if gemv_supported(x, weight, bias) and gemv_pays(weight):
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of ``[B, V]`` in two short launches (the library's reduction of one
    long row runs on few multiprocessors)."""
    if x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] > 0:
        return _argmax(x)
    return x.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; per-head norms (``[T, H, D]`` views) are flattened."""
    flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1])
    return _rms_norm(flat, weight, eps).view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x`` then ``x = norm(residual)``; returns ``(x, residual)``."""
    if not (x.is_contiguous() and residual.is_contiguous()):
        x, residual = x.contiguous(), residual.contiguous()
    _fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


#: one row is left to the FP8 GEMV, whose own amax pass was faster than reading a given scale
#: (H100, Llama-3.1-8B: GPU time of a batch-1 step 3.52 ms without the norm's rows, 3.58-3.60 with)
FP8_ROWS_MIN_TOKENS = 2


def rms_norm_fp8_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`rms_norm` of ``[T, hidden]`` and the output quantized to FP8 per token, in one
    launch: ``(out, q, scale)``; None below ``FP8_ROWS_MIN_TOKENS`` tokens."""
    if x.shape[0] < FP8_ROWS_MIN_TOKENS:
        return None
    return _rms_norm_fp8(x if x.stride(-1) == 1 else x.contiguous(), weight, eps)


def fused_add_rms_norm_fp8_rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`fused_add_rms_norm` and the normed output quantized to FP8 per token, in one
    launch: ``(x, residual, q, scale)``; None (nothing done) below ``FP8_ROWS_MIN_TOKENS``."""
    if x.shape[0] < FP8_ROWS_MIN_TOKENS:
        return None
    if not (x.is_contiguous() and residual.is_contiguous()):
        x, residual = x.contiguous(), residual.contiguous()
    q, scale = _fused_add_rms_norm_fp8(x, residual, weight, eps)
    return x, residual, q, scale


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch, computed in float32."""
    flat = gate_up if gate_up.dim() == 2 and gate_up.stride(-1) == 1 else gate_up.reshape(-1, gate_up.shape[-1])
    out = _silu_and_mul(flat)
    return out.view(*gate_up.shape[:-1], out.shape[-1])


def rotary_tables(rotary_emb: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """No per-step work: the kernel reads each position's row of the model's cos/sin table."""
    return positions, rotary_emb.cos_sin_cache(positions.device)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key in place (strided views of the qkv projection are fine)."""
    positions, cos_sin_cache = tables
    rotary_embedding(positions, query, key, cos_sin_cache)
    return query, key


OPS: dict[str, Callable[..., Any]] = {
    "linear": linear,
    "argmax": argmax,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_tables": rotary_tables,
    "apply_rotary": apply_rotary,
    "int4_linear": int4_linear,
    "fp8_linear": fp8_linear,  # declared by sonar.quantization.fp8
    "rms_norm_fp8_rows": rms_norm_fp8_rows,  # declared by sonar.quantization.fp8: the norm and its FP8 rows
    "fused_add_rms_norm_fp8_rows": fused_add_rms_norm_fp8_rows,
    "fused_moe": fused_moe,  # the experts of a mixture-of-experts layer, two grouped GEMMs
    "fused_moe_fp8": fused_moe_fp8,  # the same over FP8 experts with per-row scales (W8A16)
    "lora_shrink": lora_shrink,
    "lora_shrink_begin": lora_shrink_begin,  # on a side stream, beside the base product (decode sizes)
    "lora_linear_shrink": lora_linear_shrink,  # batch 1: the base product and the shrink in one launch
    "lora_expand": lora_expand,
    "lora_shrink_expand": lora_shrink_expand,  # one launch up to FUSED_TOKENS tokens
}
