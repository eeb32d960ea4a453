"""int4 products for one to 16 rows of activations that never reshape the unpacked nibbles.

The weight layout is ``sonar_cuda.kernels.int4_gemm``'s: ``qweight`` int32 ``[N, K / 8]``,
nibble ``j`` of word ``w`` is input ``8 w + j``. A kernel loads a tile of words and, for each
``j`` of ``tl.static_range(8)``, takes ``q_j = (word >> 4 j) & 0xF`` over the whole tile and
meets it with the activations at stride 8 (``x[8 w + j]``), so no value changes place. Nibbles
become floats by the exponent trick (``q | 0x4B000000`` is the float ``2^23 + q``), and the
zero point is folded per run of inputs inside one group: ``y += s (sum q x - z sum x)``.
Inputs are split into runs (128, 64 or 32 inputs: within one group), the runs among
``SPLIT_K`` programs per output tile (``sonar_cuda.kernels.splitk``) where the tiles alone
are too few for the GPU.

- :func:`int4_gemv_splitk` (one row): ``[BLOCK_N, RUNS, RUN_W]`` word tiles, unrolled so all
  loads of a slice are in flight before any is summed; per word four ALU operations.
- :func:`int4_skinny_gemm` (2 to 16 rows, runs of 128 inputs): per nibble one ``tl.dot`` of
  the ``[BLOCK_M, 16]`` strided activations with the exact integer nibbles.

Plain launches on preallocated tensors: decode graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar_cuda.kernels.splitk import choose_split, num_sms, sum_splits

PACK = 8
MAGIC_BITS = 0x4B000000  # float32 2^23: its low mantissa bits hold a nibble exactly
MAGIC = 8388608.0
SKINNY_RUN = 128  # inputs per run of the dot kernel: 16 words, the smallest tl.dot depth


@dataclass(frozen=True, slots=True)
class Int4Launch:
    """How an int4 kernel covers a product: output rows per program, runs of inputs per
    unrolled chunk (GEMVs), split-K factor (0: chosen from the shape), warps, stages, and for
    ``sonar_cuda.kernels.int4_unit``'s tensor-core kernel whether one product spans all
    nibble planes of a run."""

    block_n: int
    runs_per_chunk: int = 1
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1
    merged: bool = False
    x_split: bool = False  # the unit GEMV: a chunk's inputs in one load, split into nibble planes


@triton.jit
def _nibble(packed, j: tl.constexpr):
    """Nibble ``j`` of every word of ``packed`` as float32 (exact)."""
    return (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_gemv_splitk_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr,
    N,
    KW: tl.constexpr,
    GROUP: tl.constexpr,
    RUN_W: tl.constexpr,
    RUNS_PER_SPLIT: tl.constexpr,
    NUM_SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    subs = tl.arange(0, NUM_SUB)
    words = subs[None, :, None] * RUN_W + tl.arange(0, RUN_W)[None, None, :]  # [1, NUM_SUB, RUN_W]
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * KW
    run_begin = pid_k * RUNS_PER_SPLIT
    run_end = tl.minimum(run_begin + RUNS_PER_SPLIT, KW // RUN_W)
    acc = tl.zeros([BLOCK_N, NUM_SUB, RUN_W], tl.float32)
    zero_acc = tl.zeros([BLOCK_N, NUM_SUB], tl.float32)
    for c in tl.static_range(0, RUNS_PER_SPLIT, NUM_SUB):
        runs = run_begin + c + subs  # [NUM_SUB]
        run_mask = runs < run_end
        kw = (run_begin + c) * RUN_W + words
        word_mask = kw < run_end * RUN_W
        packed = tl.load(w_rows + kw, mask=row_mask[:, None, None] & word_mask, other=0, eviction_policy="evict_first")
        sz_offsets = ((runs * RUN_W * 8) // GROUP)[None, :] * N + rows[:, None]
        sz_mask = row_mask[:, None] & run_mask[None, :]
        scale = tl.load(s_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)  # [BLOCK_N, NUM_SUB]
        zero = tl.load(z_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)
        x_words = x_ptr + kw * 8
        x = tl.load(x_words, mask=word_mask, other=0.0).to(tl.float32)  # [1, NUM_SUB, RUN_W]
        qx = _nibble(packed, 0) * x
        x_sum = x
        for j in tl.static_range(1, 8):
            x = tl.load(x_words + j, mask=word_mask, other=0.0).to(tl.float32)
            qx += _nibble(packed, j) * x
            x_sum += x
        acc += qx * scale[:, :, None]
        zero_acc += scale * zero * tl.sum(x_sum, axis=2)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(zero_acc, axis=1)
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rows, y, mask=row_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _int4_skinny_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, stride_xm,
    KW: tl.constexpr,
    GROUP: tl.constexpr,
    RUNS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    RUN_W: tl.constexpr = 16
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    words = tl.arange(0, RUN_W)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + words[None, :] * 8  # [BLOCK_M, RUN_W]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * KW + words[None, :]  # [BLOCK_N, RUN_W]
    run_begin = pid_k * RUNS_PER_SPLIT
    run_end = tl.minimum(run_begin + RUNS_PER_SPLIT, KW // RUN_W)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for run in range(run_begin, run_end):
        packed = tl.load(w_rows + run * RUN_W, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        group = (run * RUN_W * 8) // GROUP
        scale = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        qx = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        x_sum = tl.zeros([BLOCK_M, RUN_W], tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_rows + run * RUN_W * 8 + j, mask=m_mask[:, None], other=0.0)  # [BLOCK_M, RUN_W]
            q = tl.trans(_nibble(packed, j).to(x.dtype))  # [RUN_W, BLOCK_N], exact integers
            if IEEE:
                qx = tl.dot(x, q, qx, input_precision="ieee")
            else:
                qx = tl.dot(x, q, qx)
            x_sum += x.to(tl.float32)
        acc += scale[None, :] * (qx - tl.sum(x_sum, axis=1)[:, None] * zero[None, :])
    out = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def run_inputs(in_features: int, group_size: int) -> int | None:
    """Inputs per run: the longest of 128, 64, 32 that both the row and a group split into
    evenly (None: these kernels do not take the shape)."""
    for run in (128, 64, 32):
        if in_features % run == 0 and group_size % run == 0:
            return run
    return None


def skinny_takes(in_features: int, group_size: int) -> bool:
    """Whether :func:`int4_skinny_gemm` takes this shape (runs of 128 inputs)."""
    return in_features % SKINNY_RUN == 0 and group_size % SKINNY_RUN == 0


def _split_of(launch: Int4Launch, num_tiles: int, num_runs: int, device: torch.device) -> tuple[int, int]:
    """``(split_k, runs per split)`` with no empty split."""
    split = launch.split_k or choose_split(num_tiles, num_runs, num_sms(device))
    runs_per_split = triton.cdiv(num_runs, max(1, min(split, num_runs)))
    return triton.cdiv(num_runs, runs_per_split), runs_per_split


def int4_gemv_splitk(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=4, runs_per_chunk=4),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one contiguous row ``x`` ``[1, K]`` (``K`` a multiple of a run,
    :func:`run_inputs`), accumulated in float32, returned ``[1, N]`` in ``x``'s dtype."""
    n, kw = qweight.shape
    run = run_inputs(kw * PACK, group_size)
    assert run is not None, f"int4_gemv_splitk takes inputs in whole runs of 32 within a group (K={kw * PACK}, group {group_size})"
    run_w = run // PACK
    num_runs = kw // run_w
    num_tiles = triton.cdiv(n, launch.block_n)
    split, runs_per_split = _split_of(launch, num_tiles, num_runs, x.device)
    num_sub = min(triton.next_power_of_2(runs_per_split), launch.runs_per_chunk * (128 // run))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemv_splitk_kernel[(num_tiles, split)](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, partials, n,
        KW=kw, GROUP=group_size, RUN_W=run_w, RUNS_PER_SPLIT=runs_per_split, NUM_SUB=num_sub,
        BLOCK_N=launch.block_n, SPLIT=split > 1, HAS_BIAS=bias is not None,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return sum_splits(partials, bias, y) if split > 1 else y


def int4_skinny_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=64, num_stages=3),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, K]``, ``M <= 16`` (rows of stride ``x.stride(0)``,
    inputs contiguous; :func:`skinny_takes` the shape), accumulated in float32, returned
    ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n, kw = qweight.shape
    assert m <= 16 and skinny_takes(k, group_size), "int4_skinny_gemm takes up to 16 rows and groups of 128 inputs"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    num_runs = kw // 16
    num_tiles = triton.cdiv(n, launch.block_n)
    split, runs_per_split = _split_of(launch, num_tiles, num_runs, x.device)
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_skinny_kernel[(num_tiles, split)](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, partials, m, n, x.stride(0),
        KW=kw, GROUP=group_size, RUNS_PER_SPLIT=runs_per_split, BLOCK_M=16, BLOCK_N=launch.block_n,
        SPLIT=split > 1, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return sum_splits(partials, bias, y) if split > 1 else y
