"""FP8 matrix-vector product for one row, split along the inputs: ``y = (q(x) . W_q) * s_x *
s_w[row] (+ b)`` with the activation quantization fused, as ``sonar_cuda.kernels.fp8_gemv``.

Where a projection has few output rows (Llama-3.1-8B's o and down: 4,096), one program per
few rows leaves multiprocessors idle; here ``SPLIT_K`` programs share each tile of rows, each
streaming one slice of the inputs in unrolled ``[BLOCK_N, BLOCK_K]`` chunks (16-byte loads),
and ``sonar_cuda.kernels.splitk`` adds the slices. A dynamic per-token scale needs the whole
row's amax: every program takes it from the row in L2 (at most 32K values, read by all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar.quantization.fp8 import FP8_MAX, MIN_AMAX
from sonar_cuda.kernels.fp8_gemv import fp8_gemv_supported
from sonar_cuda.kernels.fp8_quant import round_to_e4m3
from sonar_cuda.kernels.splitk import choose_split, num_sms, sum_splits

AMAX_BLOCK = 2048


@dataclass(frozen=True, slots=True)
class Fp8GemvLaunch:
    """Output rows per program, inputs per unrolled chunk, split-K factor (0: chosen from the
    shape), warps."""

    block_n: int
    block_k: int = 512
    split_k: int = 0
    num_warps: int = 4


@triton.jit
def _fp8_gemv_splitk_kernel(
    x_ptr, w_ptr, w_scale_ptr, in_scale_ptr, bias_ptr, y_ptr, part_ptr, N, stride_w,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    AMAX_BLOCK: tl.constexpr, STATIC: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    if STATIC:
        x_scale = tl.load(in_scale_ptr)
    else:
        amax_cols = tl.arange(0, AMAX_BLOCK)
        amax = tl.zeros([AMAX_BLOCK], tl.float32)
        for start in tl.static_range(0, K, AMAX_BLOCK):
            x = tl.load(x_ptr + start + amax_cols, mask=start + amax_cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        x_scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
    cols = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start in tl.static_range(0, K_PER_SPLIT, BLOCK_K):
        col_mask = start + cols < K
        w = tl.load(w_rows + start + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + start + cols, mask=col_mask, other=0.0).to(tl.float32)
        xq = round_to_e4m3(tl.clamp(x / x_scale, -FP8_MAX, FP8_MAX))  # exactly an FP8 value
        acc += w.to(tl.float32) * xq[None, :]
    y = tl.sum(acc, 1) * (x_scale * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0))
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rows, y, mask=row_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def fp8_gemv_splitk(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    launch: Fp8GemvLaunch = Fp8GemvLaunch(block_n=8),
) -> torch.Tensor:
    """``fp8_linear`` (``sonar.quantization.fp8``) for ``x`` holding one row ``[..., K]``
    (:func:`sonar_cuda.kernels.fp8_gemv.fp8_gemv_supported`): returns ``[..., N]`` in ``x``'s
    dtype."""
    assert fp8_gemv_supported(x, weight), "fp8_gemv_splitk takes one contiguous row and a row-major FP8 weight"
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    block_k = min(launch.block_k, triton.next_power_of_2(k))
    num_chunks = triton.cdiv(k, block_k)
    num_tiles = triton.cdiv(n, launch.block_n)
    split = launch.split_k or choose_split(num_tiles, num_chunks, num_sms(x.device), min_slice=2)
    chunks_per_split = triton.cdiv(num_chunks, max(1, min(split, num_chunks)))
    split = triton.cdiv(num_chunks, chunks_per_split)
    partials = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _fp8_gemv_splitk_kernel[(num_tiles, split)](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, partials, n, weight.stride(0),
        K=k, K_PER_SPLIT=chunks_per_split * block_k, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        AMAX_BLOCK=min(AMAX_BLOCK, triton.next_power_of_2(k)), STATIC=input_scale is not None, SPLIT=split > 1,
        HAS_BIAS=bias is not None, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=launch.num_warps,
    )  # fmt: skip
    if split > 1:
        sum_splits(partials, bias, y.view(1, n))
    return y
