"""RMSNorm, alone or fused with the residual add that precedes it, and optionally with the
per-token FP8 quantization of its output for an FP8 product that reads it next.

Rounding follows Hugging Face's Llama/Qwen RMSNorm: the residual sum is rounded to the model
dtype, normalised in float32, rounded again, then scaled by the weight. The FP8 rows are the
rounded output quantized exactly as ``sonar_cuda.kernels.fp8_quant.quantize_rows`` quantizes
it (``amax / 448`` per row, saturated, rounded to E4M3), in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from sonar_cuda.kernels.fp8_quant import round_to_e4m3


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    q_ptr,
    scale_ptr,
    stride_x_token,
    stride_residual_token,
    stride_out_token,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + token * stride_x_token + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # residual <- x + residual, rounded to the model dtype
        residual = tl.load(residual_ptr + token * stride_residual_token + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + token * stride_residual_token + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out_token + cols, y, mask=mask)
    if QUANT:
        yf = y.to(tl.float32)  # masked columns are 0: they leave the amax alone
        scale = tl.maximum(tl.max(tl.abs(yf), 0), MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + token, scale)
        q = round_to_e4m3(tl.clamp(yf / scale, -FP8_MAX, FP8_MAX))
        tl.store(q_ptr + token * HIDDEN + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and weight.is_contiguous()
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        rows[0] if rows is not None else out,
        rows[1] if rows is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        QUANT=rows is not None,
        FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX,
        num_warps=min(16, max(1, block // 256)),
    )


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension of ``x`` ``[num_tokens, hidden]``."""
    if out is None:
        out = torch.empty_like(x)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual <- x + residual``, then ``x <- rms_norm(residual) * weight``.

    Both are ``[num_tokens, hidden]`` with a contiguous last dimension; one read and one write
    of each instead of three kernels' worth.
    """
    assert residual.stride(-1) == 1 and residual.shape == x.shape
    _launch(x, residual, weight, x, eps)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` of ``x`` ``[num_tokens, hidden]`` (rows contiguous), and the output
    quantized to FP8 per token: ``(out, q [num_tokens, hidden] FP8, scale [num_tokens, 1]
    float32)``, ``out ~ q * scale``."""
    out = torch.empty_like(x)
    rows = _fp8_rows(x)
    _launch(x, None, weight, out, eps, rows)
    return out, *rows


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` (in place on ``x`` and ``residual``), returning the normed
    ``x`` quantized to FP8 per token: ``(q, scale)`` as :func:`rms_norm_fp8`."""
    assert residual.stride(-1) == 1 and residual.shape == x.shape
    rows = _fp8_rows(x)
    _launch(x, residual, weight, x, eps, rows)
    return rows


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain torch version: returns ``(normed, new_residual)``, with Hugging Face's rounding."""
    if residual is not None:
        x = (x.float() + residual.float()).to(residual.dtype)
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), residual
