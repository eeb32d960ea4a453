"""FP8 matrix-vector product for one row of activations, the activation quantization fused:
``y = (q(x) . W_q) * s_x * s_w[row] (+ b)``.

Decode at batch 1 streams every FP8 weight byte once. A program owns ``BLOCK_N`` whole output
rows at a time and issues the loads of all their bytes first (one ``[BLOCK_N, K]`` tile,
16-byte loads, the row padded to a power of two and masked); only then does it read the
activation row (from L2), take its amax (dynamic per-token scale) unless the scale is static,
round it to FP8 exactly as ``sonar_cuda.kernels.fp8_quant`` does, multiply in float32 (the
products of FP8 values are exact there) and apply both scales once at the end. With ``ITERS``
above 1 the grid is one wave of programs, each quantizing the row once and then taking every
``num_programs``-th tile of rows (long rows, where a tile per program leaves too few programs
resident on a multiprocessor: Llama-3.1-8B's down projection).

The first version took the amax before any weight load: an L2 round trip and a block-wide
reduction in front of every program's stream, 1.9-3.4 TB/s on Llama-3.1-8B's projections.
A whole-row tile is large: on the H200 (Triton 3.6) 4 rows of 14,336 inputs with 4 warps
computed wrong sums, so use the tiles ``fp8_linear.GEMV_TILES`` and the tests check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX
from sonar_cuda.kernels.fp8_quant import round_to_e4m3
from sonar_cuda.kernels.splitk import num_sms

MAX_UNROLLED_K = 32768


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, in_scale_ptr, bias_ptr, y_ptr, N, stride_w, num_programs,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, BLOCK_N)
    rows = tl.program_id(0) * BLOCK_N + r
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)  # the whole row: BLOCK_K = next power of two >= K
    col_mask = cols < K
    # the first tile's weight bytes in flight before anything waits on the activations
    w = tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :], other=0.0, eviction_policy="evict_first",
    )
    x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if STATIC:
        x_scale = tl.load(in_scale_ptr)
    else:
        x_scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) / FP8_MAX
    xq = round_to_e4m3(tl.clamp(x / x_scale, -FP8_MAX, FP8_MAX))  # exactly an FP8 value
    y = tl.sum(w.to(tl.float32) * xq[None, :], 1) * (x_scale * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0))
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    for i in range(1, ITERS):  # one wave: this program's further tiles, the row already quantized
        rows = (tl.program_id(0) + i * num_programs) * BLOCK_N + r
        row_mask = rows < N
        w = tl.load(
            w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :], other=0.0, eviction_policy="evict_first",
        )
        y = tl.sum(w.to(tl.float32) * xq[None, :], 1) * (x_scale * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0))
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _fp8_gemv_prepared_kernel(
    q_ptr, q_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, N, stride_w,
    K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):  # unrolled: every chunk's loads issue first
        col_mask = start + cols < K
        w = tl.load(w_rows + start + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0, eviction_policy="evict_first")
        q = tl.load(q_ptr + start + cols, mask=col_mask, other=0.0)
        acc += w.to(tl.float32) * q.to(tl.float32)[None, :]  # products of FP8 values: exact in float32
    y = tl.sum(acc, 1) * (tl.load(q_scale_ptr) * tl.load(w_scale_ptr + rows, mask=row_mask, other=0.0))
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


def default_tile(n: int, k: int) -> tuple[int, int, int]:
    """``(rows per program, warps, programs per multiprocessor)`` for an ``n x k`` weight, the
    last 0 for a program per tile: 8 rows for rows up to 4K, 2 rows in one wave of 2 programs
    per multiprocessor for longer ones (what the H200 sweep found best for Llama-3.1-8B)."""
    padded = triton.next_power_of_2(k)
    if padded <= 4096:
        return 8, 8, 0
    return max(1, 32768 // padded), 8 if padded <= 16384 else 16, 2


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    block_n: int = 0,
    num_warps: int = 0,
    per_sm: int = -1,
) -> torch.Tensor:
    """``fp8_linear`` (``sonar.quantization.fp8``) for ``x`` holding one row ``[..., K]``:
    returns ``[..., N]`` in ``x``'s dtype. ``block_n``, ``num_warps`` 0 and ``per_sm`` -1:
    :func:`default_tile`'s; ``per_sm`` 0 launches a program per tile of rows, more launches
    that many programs per multiprocessor, each taking several tiles."""
    assert fp8_gemv_supported(x, weight), "fp8_gemv takes one contiguous row and a row-major FP8 weight"
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    default_n, default_warps, default_per_sm = default_tile(n, k)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    per_sm = default_per_sm if per_sm < 0 else per_sm
    tiles = triton.cdiv(n, block_n)
    wave = (num_sms(x.device) if x.is_cuda else 2) * per_sm  # programs in one wave (the interpreter: 2 multiprocessors)
    iters = triton.cdiv(tiles, wave) if per_sm else 1
    grid = triton.cdiv(tiles, iters)
    _fp8_gemv_kernel[(grid,)](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, n, weight.stride(0), grid,
        K=k, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k), ITERS=iters, STATIC=input_scale is not None,
        HAS_BIAS=bias is not None, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=num_warps,
    )  # fmt: skip
    return y


def fp8_gemv_prepared(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    rows: int = 2,
) -> torch.Tensor:
    """``(q . W_q) * q_scale * s_w[row] (+ b)`` for one row ``q`` already in FP8 (``[..., K]``,
    contiguous) with its float32 scale (one element): the producer of the row (the norm)
    quantized it, so the product only streams its weights. ``rows`` output rows a program; the
    activation row comes from L2 in every program, the weight in chunks of up to 4,096 bytes
    whose loads all issue before any is summed. Returns ``[..., N]`` in ``out_dtype``.

    On an H100 at Llama-3.1-8B's projections (us; the GEMV that quantizes its row itself in
    brackets): qkv 10.7 (10.5), o 8.0 (8.5), gate_up 40.1 (41.4), down 23.0 (23.3) with 2 rows a
    program; 1 row was slower (11.9 / 8.7 / 48.2 / 24.4). The engine's norms hand over FP8 rows
    from two tokens (``sonar_cuda.ops.FP8_ROWS_MIN_TOKENS``), so at one token the products still
    quantize their rows themselves."""
    assert fp8_gemv_supported(q, weight) and q.dtype == FP8_DTYPE and q_scale.numel() == 1
    n, k = weight.shape
    y = torch.empty(*q.shape[:-1], n, dtype=out_dtype, device=q.device)
    if n == 0:
        return y
    block_k = min(4096, triton.next_power_of_2(k))
    _fp8_gemv_prepared_kernel[(triton.cdiv(n, rows),)](
        q, q_scale, weight, weight_scale, bias if bias is not None else weight_scale, y, n, weight.stride(0),
        K=k, BLOCK_K=block_k, ROWS=rows, HAS_BIAS=bias is not None, num_warps=max(1, min(8, block_k // 512)),
    )  # fmt: skip
    return y
