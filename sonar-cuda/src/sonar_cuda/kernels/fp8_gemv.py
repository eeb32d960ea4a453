"""FP8 matrix-vector product for one row of activations, the activation quantization fused:
``y = (q(x) . W_q) * s_x * s_w[row] (+ b)``.

Decode at batch 1 streams every FP8 weight byte once. Each program owns ``BLOCK_N`` output
rows, so the activation row (read from L2) serves several weight rows; it first takes the
row's amax (dynamic per-token scale) unless the scale is static, then rounds each chunk of the
activations to FP8 exactly as ``sonar_cuda.kernels.fp8_quant`` would, multiplies in float32
(the products of FP8 values are exact there) and applies both scales once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from sonar_cuda.kernels.fp8_quant import round_to_e4m3

MAX_UNROLLED_K = 32768


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, in_scale_ptr, bias_ptr, y_ptr, N, stride_w,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    if STATIC:
        x_scale = tl.load(in_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for start in tl.static_range(0, K, BLOCK_K):
            x = tl.load(x_ptr + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        x_scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        col_mask = start + cols < K
        w = tl.load(w_rows + start + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + start + cols, mask=col_mask, other=0.0).to(tl.float32)
        xq = round_to_e4m3(tl.clamp(x / x_scale, -FP8_MAX, FP8_MAX))  # exactly an FP8 value
        acc += w.to(tl.float32) * xq[None, :]
    y = tl.sum(acc, 1) * (x_scale * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0))
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def fp8_gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_gemv` computes this product: one contiguous row of ``x`` and an FP8
    row-major ``weight`` on its device, rows no longer than ``MAX_UNROLLED_K``."""
    k = weight.shape[-1]
    return (
        weight.dtype == FP8_DTYPE and weight.dim() == 2 and weight.stride(1) == 1 and x.numel() == k
        and x.shape[-1] == k and x.stride(-1) == 1 and 0 < k <= MAX_UNROLLED_K and x.device == weight.device
    )


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    block_n: int = 4,
    block_k: int = 512,
    num_warps: int = 4,
) -> torch.Tensor:
    """``fp8_linear`` (``sonar.quantization.fp8``) for ``x`` holding one row ``[..., K]``:
    returns ``[..., N]`` in ``x``'s dtype."""
    assert fp8_gemv_supported(x, weight), "fp8_gemv takes one contiguous row and a row-major FP8 weight"
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_k = min(block_k, triton.next_power_of_2(k))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, n, weight.stride(0),
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, STATIC=input_scale is not None, HAS_BIAS=bias is not None,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=num_warps,
    )
    return y
