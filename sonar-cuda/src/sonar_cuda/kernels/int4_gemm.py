"""Products with int4 weights in Sonar's GPTQ/AWQ runtime layout, dequantized in registers.

The layout (``sonar.quantization.int4_packing``): ``qweight`` int32 ``[N, K / 8]`` (8 inputs of
an output row per word, low nibble first), ``scales`` and ``qzeros`` ``[K / group, N]`` in the
activations' dtype, ``W[n, k] = (q[n, k] - zero[g, n]) * scale[g, n]`` with ``g = k // group``.

- :func:`int4_gemv` (one row of activations, decode at batch 1): each program owns ``BLOCK_N``
  output rows and streams them once, in unrolled chunks whose loads are all issued before any
  is summed; per run of inputs inside one group it sums ``q * x`` and applies the group's
  scale and zero point once, ``y += s * (sum(q x) - z * sum(x))``, so a weight costs a shift, a
  mask, a conversion and a multiply-add.
- :func:`int4_gemm` (several rows): ``[BLOCK_M, BLOCK_N]`` tiles; each ``[BLOCK_N, BLOCK_K]``
  weight tile is unpacked and dequantized to the activations' dtype, then one ``tl.dot``.

Both are plain launches on preallocated outputs (no host sync), so decode graphs capture them.
:func:`int4_linear` runs one to 16 rows through the kernels that do not reshape the nibbles
(``sonar_cuda.kernels.int4_unit``): ``DEFAULT_CHOICES`` names the kernel and launch per rows
bucket, ``CHOICES`` per shape where ``benchmarks/int4_sweep.py`` found better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar_cuda.kernels.int4_unit import DOT_ROWS, Int4Launch, dot_takes, int4_dot_rows, int4_gemv_rows, int4_gemv_unit, int4_planes, rows_words, run_inputs

PACK = 8  # int4 values per int32 word
# the GEMV's launch: output rows per program, inputs per unrolled chunk, warps (the best of
# int4_decode.py --sweep on an H200: 30-172 us per Llama-3.1-8B projection, still 1.6-2.5x
# the bf16 GEMV; the unpacking, not the memory, bounds it)
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 2, 1024, 4


@dataclass(frozen=True, slots=True)
class Int4Choice:
    """Which kernel runs a product of 1 to 16 rows, and its launch: ``"unit"``
    (``sonar_cuda.kernels.int4_unit``: the unit-float GEMV at one row, the transposed
    tensor-core product for more), ``"planes"`` (the nibble-plane tensor-core product at every
    row count, one row included; 16-bit activations), ``"rows"`` (one row: the GEMV whose
    threads each hold several output rows, the activations in plane order; other row counts
    as ``"planes"``) or ``"tiled"`` (the GEMV and tiled GEMM
    here; no launch)."""

    kernel: str
    launch: Int4Launch | None = None


# from benchmarks/int4_sweep.py on an H100 (Llama-3.1-8B, group 128, bf16 activations; us per
# product). One row: the unit-float GEMV, 8 output rows per program over chunks of 512 inputs,
# for qkv (12.6; the nibble planes 13.8) and o (9.2 with the next chunk's words prefetched, 9.4
# without; the planes 10.5), the nibble planes for gate_up (37.8 with 512 rows a program in 2
# slices; 45.4 split as ``choose_split`` picks) and down (21.8 in 8 slices); bf16 17.7 / 12.5 /
# 88.2 / 45.2. 2 to 16 rows: the nibble planes with 256 output rows a program, split as
# ``choose_split`` picks (at 16 rows o 11.3), qkv in 4 slices (14.6; 17.7 split as picked),
# gate_up with 512 rows in 2 slices (40.4; 52.1 split as picked) and down in 8 slices (24.2);
# bf16 21.5 / 15.7 / 95.0 / 48.6
DEFAULT_CHOICES = {
    1: Int4Choice("unit", Int4Launch(block_n=8, runs_per_chunk=4)),
    4: Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3)),
    16: Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3)),
}
# (rows bucket, N, K) -> the choice where it differs from DEFAULT_CHOICES
CHOICES: dict[tuple[int, int, int], Int4Choice] = {
    (1, 4096, 4096): Int4Choice("unit", Int4Launch(block_n=8, runs_per_chunk=4, prefetch=1)),
    (1, 28672, 4096): Int4Choice("planes", Int4Launch(block_n=512, num_warps=8, num_stages=3, split_k=2)),
    (1, 4096, 14336): Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3, split_k=8)),
    (4, 4096, 14336): Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3, split_k=8)),
    (16, 6144, 4096): Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3, split_k=4)),
    (16, 28672, 4096): Int4Choice("planes", Int4Launch(block_n=512, num_warps=8, num_stages=3, split_k=2)),
    (16, 4096, 14336): Int4Choice("planes", Int4Launch(block_n=256, num_warps=8, num_stages=3, split_k=8)),
}


def rows_bucket(m: int) -> int:
    """The ``CHOICES`` key for ``m`` rows: 1, 4 (2 to 4) or 16 (5 to 16)."""
    return 1 if m == 1 else 4 if m <= 4 else 16


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    N,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # a chunk of BLOCK_K inputs is NUM_SUB runs of SUB inputs, each inside one group; the chunk
    # loop is unrolled so every chunk's loads are issued before any is summed
    NUM_SUB: tl.constexpr = BLOCK_K // SUB
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    subs = tl.arange(0, NUM_SUB)
    ks = subs[None, :, None] * SUB + tl.arange(0, SUB)[None, None, :]  # [1, NUM_SUB, SUB]
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * (K // 8)
    acc = tl.zeros([BLOCK_N, NUM_SUB], tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        k = start + ks
        sub_mask = start + subs * SUB < K
        packed = tl.load(w_rows + k // 8, mask=row_mask[:, None, None] & (k < K), other=0, eviction_policy="evict_first")
        q = ((packed >> ((k % 8) * 4)) & 0xF).to(tl.float32)  # [BLOCK_N, NUM_SUB, SUB]
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [1, NUM_SUB, SUB]
        qx = tl.sum(q * x, axis=2)  # [BLOCK_N, NUM_SUB]
        x_sum = tl.sum(x, axis=2)  # [1, NUM_SUB]
        groups = (start + subs * SUB) // GROUP
        sz_offsets = groups[None, :] * N + rows[:, None]
        sz_mask = row_mask[:, None] & sub_mask[None, :]
        scale = tl.load(s_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)
        acc += scale * (qx - zero * x_sum)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, stride_xm, stride_ym,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * (K // 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        packed = tl.load(w_rows + (k0 // 8 + words)[None, :], mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K / 8]
        q = tl.reshape((packed[:, :, None] >> shifts) & 0xF, (BLOCK_N, BLOCK_K))
        group = k0 // GROUP
        scale = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - zero[:, None]) * scale[:, None]).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(in_features: int, group_size: int) -> int | None:
    """The longest chunk of inputs (128, 64 or 32) that both the row and a group split into
    evenly (None: the kernels do not take this shape)."""
    for block_k in (128, 64, 32):
        if in_features % block_k == 0 and group_size % block_k == 0:
            return block_k
    return None


def int4_supported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_gemv` / :func:`int4_gemm` compute this product: a floating ``x`` of
    the scales' dtype on their device, inputs that split into whole chunks and groups."""
    k = qweight.shape[1] * PACK
    return (
        x.shape[-1] == k
        and x.dtype == scales.dtype
        and x.dtype.is_floating_point
        and x.device == qweight.device
        and qweight.is_contiguous()
        and block_k_for(k, group_size) is not None
    )


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one contiguous row ``x`` ``[1, K]``, accumulated in float32,
    returned ``[1, N]`` in ``x``'s dtype (``block_n``, ``block_k``, ``num_warps``: the launch,
    for tuning)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    sub = block_k_for(k, group_size)
    block_n = block_n or GEMV_BLOCK_N
    block_k = max(sub, min(block_k or GEMV_BLOCK_K, triton.next_power_of_2(k)))
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, n,
        K=k, GROUP=group_size, SUB=sub, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, num_warps=num_warps or GEMV_WARPS,
    )  # fmt: skip
    return y


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, K]`` (rows of stride ``x.stride(0)``, inputs
    contiguous), accumulated in float32, returned ``[M, N]`` in ``x``'s dtype (``blocks``:
    ``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the launch, for tuning)."""
    m, n, k = x.shape[0], qweight.shape[0], qweight.shape[1] * PACK
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k = blocks or gemm_blocks(m, k, group_size)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, m, n, x.stride(0), y.stride(0),
        K=k, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=4 if block_m * block_n <= 4096 else 8, num_stages=3,
    )  # fmt: skip
    return y


def gemm_blocks(m: int, k: int, group_size: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the tiled GEMM for ``m`` rows: few rows, narrow
    tiles (enough programs to stream the weight); many rows, larger ones."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 32 else 64 if m <= 256 else 128
    return block_m, block_n, min(block_k_for(k, group_size), 64 if m > 256 else 128)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``"int4_linear"`` operation (``sonar.quantization.int4_packing.int4_linear``) for
    ``x`` ``[..., K]``: the GEMV for one row, the tiled GEMM for more; shapes the kernels do
    not take are dequantized and run by the library."""
    if input_order is not None:
        x = x.index_select(-1, input_order)
    if not int4_supported(x, qweight, scales, group_size):
        from sonar.quantization.int4_packing import dequantize_int4

        weight = dequantize_int4(qweight, scales, qzeros, group_size).to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m, n, k = flat.shape[0], qweight.shape[0], flat.shape[1]
    if 1 <= m <= DOT_ROWS:
        bucket = rows_bucket(m)
        out = run_choice(CHOICES.get((bucket, n, k), DEFAULT_CHOICES[bucket]), flat, qweight, scales, qzeros, group_size, bias)
        if out is not None:
            return out.view(*x.shape[:-1], n)
    if m == 1 and flat.is_contiguous():
        out = int4_gemv(flat, qweight, scales, qzeros, group_size, bias)
    else:
        out = int4_gemm(flat, qweight, scales, qzeros, group_size, bias)
    return out.view(*x.shape[:-1], qweight.shape[0])


def run_choice(
    choice: Int4Choice,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, K]`` (1 to 16 rows) by ``choice``'s kernel; None
    where that kernel does not take the shape (the caller falls back to the kernels here)."""
    m, k = x.shape
    if choice.kernel == "unit":
        if m == 1 and x.is_contiguous() and run_inputs(k, group_size):
            return int4_gemv_unit(x, qweight, scales, qzeros, group_size, bias, choice.launch)
        if dot_takes(k, group_size):
            return int4_dot_rows(x, qweight, scales, qzeros, group_size, bias, choice.launch)
    if choice.kernel == "rows" and m == 1 and x.is_contiguous() and rows_words(k, group_size, choice.launch.num_warps):
        return int4_gemv_rows(x, qweight, scales, qzeros, group_size, bias, choice.launch)
    if choice.kernel in ("planes", "rows") and x.dtype in (torch.bfloat16, torch.float16) and dot_takes(k, group_size):
        return int4_planes(x, qweight, scales, qzeros, group_size, bias, choice.launch)
    return None


def reference_int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain float32 torch version (returns float32)."""
    from sonar.quantization.int4_packing import dequantize_int4

    y = x.float() @ dequantize_int4(qweight, scales, qzeros, group_size).t()
    return y if bias is None else y + bias.float()
