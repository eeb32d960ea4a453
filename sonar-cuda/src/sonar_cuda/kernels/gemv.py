"""Matrix-vector product for one row of activations: ``y = x @ W.T`` with ``x`` ``[1, K]``.

Batch-1 decode reads every weight once per token, so its speed is the rate at which these
products stream the weights. For the mid-sized projections of an 8B model (4096 x 4096,
6144 x 4096, 4096 x 14336) the library kernels stay well under the copy bandwidth; this one
gives each program ``BLOCK_N`` whole rows and walks ``K`` in ``BLOCK_K`` steps, accumulating in
float32. :func:`pick_gemv` times it against ``torch.nn.functional.linear`` once per weight
shape and keeps whichever is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CONFIGS = ((4, 1024), (8, 512), (16, 256))  # (BLOCK_N, BLOCK_K) tried for each shape


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 8, block_k: int = 512) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[1, K]`` and a row-contiguous ``weight`` ``[N, K]``."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1, "gemv takes one contiguous row"
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return y


_CHOICES: dict[tuple[int, int, torch.dtype, str], tuple[int, int] | None] = {}


def pick_gemv(weight: torch.Tensor, x: torch.Tensor) -> tuple[int, int] | None:
    """The fastest (BLOCK_N, BLOCK_K) for this weight's shape, or None where the library's
    ``linear`` is at least as fast (timed once per shape with CUDA events; while a CUDA graph
    is being captured an untimed shape takes the library)."""
    key = (weight.shape[0], weight.shape[1], weight.dtype, str(weight.device))
    if key in _CHOICES:
        return _CHOICES[key]
    if weight.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None

    def time_it(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    best, best_time = None, time_it(lambda: F.linear(x, weight))
    for block_n, block_k in CONFIGS:
        elapsed = time_it(lambda: gemv(x, weight, None, block_n, block_k))
        if elapsed < 0.97 * best_time:  # a clear win only
            best, best_time = (block_n, block_k), elapsed
    _CHOICES[key] = best
    return best


def reference_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 reference."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y
