"""Activations to FP8 (E4M3) in one launch: a dynamic scale per row (``amax / 448``) or one
static scale, the row saturated to +-448 and rounded, as ``sonar.quantization.fp8.to_fp8``
does in torch. No host synchronisation, so it runs inside CUDA graphs.

Values are rounded to the E4M3 grid in float32 (:func:`round_to_e4m3`) before the cast, which
is then exact: the same bits on the GPU and in Triton's interpreter, whose own float8 cast
rounds values just below a power of two down an octave (124.3 to 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

MAX_BLOCK = 4096


@triton.jit
def round_to_e4m3(v):
    """``v`` (float32, within +-448) rounded to the nearest E4M3 value, ties to even."""
    bits = v.to(tl.uint32, bitcast=True)
    # normal range: keep 3 of the 23 mantissa bits, rounding half to even (a carry bumps the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal range (below 2^-6): multiples of 2^-9, rounded by a float32 addition that lands
    # in [2^14, 2^15), where float32's step is 2^-9
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, stride_x, K,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.clamp(x / scale, -FP8_MAX, FP8_MAX))
        tl.store(q_ptr + row * K + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x`` ``[M, K]`` (rows contiguous): ``q`` FP8 ``[M, K]`` row-major and
    ``scale`` float32 ``[M, 1]`` per row, or ``static_scale`` (a float32 scalar tensor)
    broadcast to ``[M, 1]``; ``x ~ q * scale``."""
    m, k = x.shape
    assert x.stride(-1) == 1, "quantize_rows takes rows that are contiguous"
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    static = static_scale is not None
    scale = static_scale.reshape(1, 1).expand(m, 1).contiguous() if static else torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    _quant_rows_kernel[(m,)](
        x, q, scale, static_scale if static else scale, x.stride(0), k,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK=min(MAX_BLOCK, triton.next_power_of_2(k)), STATIC=static,
        num_warps=4,
    )
    return q, scale
