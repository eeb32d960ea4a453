"""int4 products for one to 16 rows of activations, the nibbles read as unit floats or as
16-bit planes less the zero point.

The weight layout is ``sonar_cuda.kernels.int4_gemm``'s: ``qweight`` int32 ``[N, K / 8]``,
nibble ``j`` of word ``w`` is input ``8 w + j``; ``scales`` and ``qzeros`` ``[K / group, N]``.

A nibble ``q`` becomes a float in two integer operations and no conversion: shifted to bits
19-22 and or-ed under the exponent of 1.0, the word is the float32 ``1 + q / 16`` (exact, and
exact in bfloat16 and float16 too). Over a run of inputs inside one group,

    sum (q - z) x = 16 sum (1 + q / 16) x - (16 + z) sum x,

so a weight costs a shift, a mask-and-or and one multiply-add (or a tensor-core product), and
the zero point and the scale are applied once per run and output. Inputs are split into runs
(128, 64 or 32 inputs, inside one group) and the runs among ``SPLIT_K`` programs per output
tile (``sonar_cuda.kernels.splitk``) where the tiles alone are too few for the GPU.

- :func:`int4_gemv_unit` (one row): ``[BLOCK_N, RUNS, RUN_W]`` word tiles, all loads of a
  slice in flight before any is summed; a program's threads share its activations across
  the ``BLOCK_N`` output rows each holds. The activations of a nibble plane are read at a
  stride of 8 (loading a chunk's inputs at once and splitting them into the planes in
  registers was measured slower at every Llama-3.1-8B shape on an H200).
- :func:`int4_gemv_rows` (one row): each thread holds one 16-byte vector of words of
  ``BLOCK_N`` output rows, and reads the activations of those words from a copy in plane order
  (:func:`x_planes`: float32, per block of 32 inputs plane ``j``'s four inputs side by side), so
  one 16-byte load serves a plane of four words for all ``BLOCK_N`` rows, where the GEMV above
  loads one 2-byte input per weight and thread. The scale and zero point apply per group after
  the group's words are summed.
- :func:`int4_dot_rows` (2 to 16 rows): the transposed product ``W x^T`` per tile, so the
  dequantized weight tile is the tensor-core product's left operand as it was loaded, with
  no transposition; per nibble plane one product of depth ``RUN_W`` words.
- :func:`int4_planes` (1 to 16 rows, 16-bit activations): the same product, its planes not
  unit floats but ``q - z`` itself, exact in bfloat16 and float16. A byte permute pairs two
  adjacent words' nibbles into the halves of a register; a shift and a mask-and-or make two
  ``OFFSET + q`` (under the exponent whose unit is 1); one paired subtraction takes the zero
  point off. That is three instructions per pair of weights, in the register pairs the
  tensor-core operand reads (inline PTX on the GPU; plain operations with the same values
  under Triton's interpreter). No sum of the activations is needed. The
  eight planes side by side are one operand of depth 128 (input ``j * 16 + w`` of a run is
  plane ``j``'s word ``w``), so a run is one product: its tensor-core instructions issue back
  to back, with one wait, where a product per plane waited eight times. The activations of a
  run are read once as ``[word, row, nibble]`` (16 contiguous bytes each) and put in the same
  order; the next run's scales and zero points are loaded before the current run's products.

Plain launches on preallocated tensors: decode graphs capture them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar_cuda.kernels.splitk import choose_split, num_sms, sum_splits

PACK = 8
DOT_RUN = 128  # inputs per run of the tensor-core kernel: 16 words, the smallest product depth
DOT_ROWS = 16  # activation rows one tensor-core program covers


@dataclass(frozen=True, slots=True)
class Int4Launch:
    """How a kernel here covers a product: output rows per program, runs of inputs per
    unrolled chunk (GEMV) or per step of the loop (nibble planes), split-K factor (0: chosen
    from the shape), warps and stages, and ``prefetch`` (GEMV, 0 or 1): whether the next
    chunk's words are loaded before the current chunk is summed, held in registers."""

    block_n: int
    runs_per_chunk: int = 1
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1
    prefetch: int = 0


@triton.jit
def _unit(packed, j: tl.constexpr):
    """Nibble ``j`` of every word of ``packed`` as the float32 ``1 + q / 16`` (exact)."""
    if 4 * j <= 19:
        bits = packed << (19 - 4 * j)
    else:
        bits = packed >> (4 * j - 19)
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


# Two adjacent words ``a``, ``b`` of a row (``$8``, ``$9``) and their row's ``OFFSET + zero``
# twice (``$10``) -> for each nibble plane ``j`` one register holding the two 16-bit floats
# ``[q_j(a) - zero, q_j(b) - zero]``: one byte permute gathers both words' low (or high) four
# nibbles into the two halves; per plane a shift and a mask-and-or under the exponent whose
# unit is 1 (0x4300: bfloat16 128 + q, 0x6400: float16 1024 + q), and one paired subtraction
# (exact: small integers). Three instructions per pair of weights, against about five per
# weight for a float32 unit and its conversion, and the pairs are the tensor-core operand's
# registers as they stand.
_PLANES_ASM = """
{{
.reg .b32 lo, hi, t;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t, lo, 0x000F000F, {e}, 0xEA;
sub.{s} $0, t, $10;
shr.b32 t, lo, 4;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $1, t, $10;
shr.b32 t, lo, 8;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $2, t, $10;
shr.b32 t, lo, 12;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $3, t, $10;
lop3.b32 t, hi, 0x000F000F, {e}, 0xEA;
sub.{s} $4, t, $10;
shr.b32 t, hi, 4;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $5, t, $10;
shr.b32 t, hi, 8;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $6, t, $10;
shr.b32 t, hi, 12;
lop3.b32 t, t, 0x000F000F, {e}, 0xEA;
sub.{s} $7, t, $10;
}}
"""
PLANES_BF16 = tl.constexpr(_PLANES_ASM.format(e="0x43004300", s="rn.bf16x2"))
PLANES_F16 = tl.constexpr(_PLANES_ASM.format(e="0x64006400", s="rn.f16x2"))
PLANES_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r")


@triton.jit
def _plane16(packed, zero, j: tl.constexpr, dtype: tl.constexpr):
    """Nibble ``j`` of every word less ``zero``, in the 16-bit ``dtype`` (plain operations)."""
    return (((packed >> (4 * j)) & 0xF).to(tl.float32) - zero).to(dtype)


@triton.jit
def _planes16(packed, zero, F16: tl.constexpr, ASM: tl.constexpr):
    """The eight nibble planes of ``packed`` ``[BLOCK_N, W]`` less each row's ``zero``
    ``[BLOCK_N, 1]`` (an integer, as GPTQ and AWQ store them), as 16-bit floats (exact): by
    the byte-permute assembly on a GPU (``ASM``), by plain operations elsewhere (Triton's
    interpreter); the same values either way."""
    if ASM and F16:
        zero_bits = (zero + 1024.0).to(tl.float16)
        planes = tl.inline_asm_elementwise(PLANES_F16, PLANES_CONSTRAINTS, [packed, zero_bits], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    elif ASM:
        zero_bits = (zero + 128.0).to(tl.bfloat16)
        planes = tl.inline_asm_elementwise(PLANES_BF16, PLANES_CONSTRAINTS, [packed, zero_bits], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        dt: tl.constexpr = tl.float16 if F16 else tl.bfloat16
        planes = (
            _plane16(packed, zero, 0, dt), _plane16(packed, zero, 1, dt), _plane16(packed, zero, 2, dt), _plane16(packed, zero, 3, dt),
            _plane16(packed, zero, 4, dt), _plane16(packed, zero, 5, dt), _plane16(packed, zero, 6, dt), _plane16(packed, zero, 7, dt),
        )  # fmt: skip
    return planes


@triton.jit
def _planes_product(packed, zero, xr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, RUN_W: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """One run's product ``[BLOCK_N, BLOCK_M]`` (float32, before the group's scale): the words
    ``packed`` ``[BLOCK_N, RUN_W]`` as nibble planes less each row's ``zero``, side by side as
    one operand of depth ``8 * RUN_W`` (input ``j * RUN_W + w``: plane ``j``'s word ``w``),
    against the run's activations ``xr`` ``[RUN_W, BLOCK_M, 8]`` put in the same order."""
    p = _planes16(packed, zero[:, None], F16, ASM)
    a = tl.join(tl.join(tl.join(p[0], p[4]), tl.join(p[2], p[6])), tl.join(tl.join(p[1], p[5]), tl.join(p[3], p[7])))
    a = tl.reshape(tl.permute(a, (0, 2, 3, 4, 1)), [BLOCK_N, 8 * RUN_W])  # [n, plane bits 4 2 1, word]
    return tl.dot(a, tl.reshape(tl.permute(xr, (2, 0, 1)), [8 * RUN_W, BLOCK_M]))


@triton.jit
def _store_row(y, rows, row_mask, pid_k, N, bias_ptr, y_ptr, part_ptr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A one-row GEMV's float32 sums ``y`` for output ``rows``: this slice's partial row
    (``SPLIT``), or the output rounded to its dtype, plus the bias."""
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rows, y, mask=row_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _int4_gemv_unit_kernel(
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
    PREFETCH: tl.constexpr,
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
    if PREFETCH:
        first_kw = run_begin * RUN_W + words
        next_packed = tl.load(w_rows + first_kw, mask=row_mask[:, None, None] & (first_kw < run_end * RUN_W), other=0, eviction_policy="evict_first")
    for c in tl.static_range(0, RUNS_PER_SPLIT, NUM_SUB):
        runs = run_begin + c + subs  # [NUM_SUB]
        run_mask = runs < run_end
        kw = (run_begin + c) * RUN_W + words
        word_mask = kw < run_end * RUN_W
        if PREFETCH:  # this chunk's words were loaded before the previous chunk's sums
            packed = next_packed
            if c + NUM_SUB < RUNS_PER_SPLIT:
                next_kw = kw + NUM_SUB * RUN_W
                next_mask = row_mask[:, None, None] & (next_kw < run_end * RUN_W)
                next_packed = tl.load(w_rows + next_kw, mask=next_mask, other=0, eviction_policy="evict_first")
        else:
            packed = tl.load(w_rows + kw, mask=row_mask[:, None, None] & word_mask, other=0, eviction_policy="evict_first")
        sz_offsets = ((runs * RUN_W * 8) // GROUP)[None, :] * N + rows[:, None]
        sz_mask = row_mask[:, None] & run_mask[None, :]
        scale = tl.load(s_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)  # [BLOCK_N, NUM_SUB]
        zero = tl.load(z_ptr + sz_offsets, mask=sz_mask, other=0.0).to(tl.float32)
        x_words = x_ptr + kw * 8
        x = tl.load(x_words, mask=word_mask, other=0.0).to(tl.float32)  # [1, NUM_SUB, RUN_W]: plane 0's inputs, at stride 8
        unit_x = _unit(packed, 0) * x
        x_sum = x
        for j in tl.static_range(1, 8):
            x = tl.load(x_words + j, mask=word_mask, other=0.0).to(tl.float32)
            unit_x += _unit(packed, j) * x
            x_sum += x
        acc += unit_x * scale[:, :, None]
        zero_acc += scale * (16.0 + zero) * tl.sum(x_sum, axis=2)
    y = 16.0 * tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(zero_acc, axis=1)
    _store_row(y, rows, row_mask, pid_k, N, bias_ptr, y_ptr, part_ptr, SPLIT, HAS_BIAS)


# (a & 0x780000) | 0x3F800000 in one instruction (the compiler emits an and, then an or)
_UNIT_ASM = tl.constexpr("lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xEA;")


@triton.jit
def _unit_fast(packed, j: tl.constexpr, ASM: tl.constexpr):
    """:func:`_unit`, the mask and the exponent in one instruction on a GPU (``ASM``)."""
    if ASM:
        if 4 * j <= 19:
            bits = packed << (19 - 4 * j)
        else:
            bits = packed >> (4 * j - 19)
        return tl.inline_asm_elementwise(_UNIT_ASM, "=r,r", [bits], dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:
        return _unit(packed, j)


@triton.jit
def _int4_gemv_rows_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr,
    N,
    KW: tl.constexpr,
    GROUP: tl.constexpr,
    WORDS_PER_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    GW: tl.constexpr = GROUP // 8  # words per group
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    words = tl.arange(0, BLOCK_W)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KW
    k_begin = pid_k * WORDS_PER_SPLIT
    y = tl.zeros([BLOCK_N], tl.float32)
    for w0 in tl.static_range(0, WORDS_PER_SPLIT, BLOCK_W):
        kw = k_begin + w0 + words
        word_mask = kw < KW
        packed = tl.load(w_rows + kw[None, :], mask=row_mask[:, None] & word_mask[None, :], other=0, eviction_policy="evict_first")
        x_words = x_ptr + (kw // 4) * 32 + kw % 4  # plane 0 of each word in x_planes' order; plane j 4 j further
        x = tl.load(x_words, mask=word_mask, other=0.0)
        unit_x = _unit_fast(packed, 0, ASM) * x[None, :]
        x_sum = x
        for j in tl.static_range(1, 8):
            x = tl.load(x_words + 4 * j, mask=word_mask, other=0.0)
            unit_x += _unit_fast(packed, j, ASM) * x[None, :]
            x_sum += x
        groups = (k_begin + w0) // GW + tl.arange(0, BLOCK_W // GW)
        dot = tl.sum(tl.reshape(unit_x, [BLOCK_N, BLOCK_W // GW, GW]), axis=2)
        x_group = tl.sum(tl.reshape(x_sum, [BLOCK_W // GW, GW]), axis=1)
        sz = groups[None, :] * N + rows[:, None]
        sz_mask = row_mask[:, None] & (groups < KW // GW)[None, :]
        scale = tl.load(s_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
        y += tl.sum(scale * (16.0 * dot - (16.0 + zero) * x_group[None, :]), axis=1)
    _store_row(y, rows, row_mask, pid_k, N, bias_ptr, y_ptr, part_ptr, SPLIT, HAS_BIAS)


@triton.jit
def _int4_dot_rows_kernel(
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
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * KW + words[None, :]  # [BLOCK_N, RUN_W]
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + words[:, None] * 8  # [RUN_W, BLOCK_M]
    run_begin = pid_k * RUNS_PER_SPLIT
    run_end = tl.minimum(run_begin + RUNS_PER_SPLIT, KW // RUN_W)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for run in range(run_begin, run_end):
        packed = tl.load(w_rows + run * RUN_W, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        group = (run * RUN_W * 8) // GROUP
        scale = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        unit_x = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        x_sum = tl.zeros([RUN_W, BLOCK_M], tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_cols + run * RUN_W * 8 + j, mask=m_mask[None, :], other=0.0)  # [RUN_W, BLOCK_M]
            unit = _unit(packed, j).to(x.dtype)  # [BLOCK_N, RUN_W], exact
            if IEEE:
                unit_x = tl.dot(unit, x, unit_x, input_precision="ieee")
            else:
                unit_x = tl.dot(unit, x, unit_x)
            x_sum += x.to(tl.float32)
        x_total = tl.sum(x_sum, axis=0)
        acc += scale[:, None] * (16.0 * unit_x - (16.0 + zero)[:, None] * x_total[None, :])
    out = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] of y [M, N]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_planes_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, stride_xm,
    KW: tl.constexpr,
    GROUP: tl.constexpr,
    RUNS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    F16: tl.constexpr,
    ASM: tl.constexpr,
    RUNS_PER_ITER: tl.constexpr,
):  # fmt: skip
    RUN_W: tl.constexpr = 16
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    words = tl.arange(0, RUN_W)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * KW + words[None, :]  # [BLOCK_N, RUN_W]
    # a run's activations as [word, row, nibble]: input 8 w + j, 16 contiguous bytes per (word, row)
    x_cube = x_ptr + offs_m.to(tl.int64)[None, :, None] * stride_xm + words[:, None, None] * 8 + tl.arange(0, 8)[None, None, :]
    run_begin = pid_k * RUNS_PER_SPLIT
    run_end = tl.minimum(run_begin + RUNS_PER_SPLIT, KW // RUN_W)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if RUNS_PER_ITER == 1:
        # each run loads the next run's scales and zero points before its products: their
        # latency hides behind the products instead of stalling the program
        group = (run_begin * RUN_W * 8) // GROUP
        scale = tl.load(s_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        for run in range(run_begin, run_end):
            packed = tl.load(w_rows + run * RUN_W, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
            xr = tl.load(x_cube + run * RUN_W * 8, mask=m_mask[None, :, None], other=0.0)  # [RUN_W, BLOCK_M, 8]
            next_group = (tl.minimum(run + 1, run_end - 1) * RUN_W * 8) // GROUP
            next_scale = tl.load(s_ptr + next_group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            next_zero = tl.load(z_ptr + next_group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += scale[:, None] * _planes_product(packed, zero, xr, BLOCK_N, BLOCK_M, RUN_W, F16, ASM)
            scale, zero = next_scale, next_zero
    else:  # RUNS_PER_ITER runs a step of the loop, each with its own group's scales (a run past the slice adds zero)
        for first in range(run_begin, run_end, RUNS_PER_ITER):
            for i in tl.static_range(RUNS_PER_ITER):
                run = first + i
                live = run < run_end
                packed = tl.load(w_rows + run * RUN_W, mask=n_mask[:, None] & live, other=0, eviction_policy="evict_first")
                xr = tl.load(x_cube + run * RUN_W * 8, mask=m_mask[None, :, None] & live, other=0.0)
                run_group = (run * RUN_W * 8) // GROUP
                run_scale = tl.load(s_ptr + run_group * N + offs_n, mask=n_mask & live, other=0.0).to(tl.float32)
                run_zero = tl.load(z_ptr + run_group * N + offs_n, mask=n_mask & live, other=0.0).to(tl.float32)
                acc += run_scale[:, None] * _planes_product(packed, run_zero, xr, BLOCK_N, BLOCK_M, RUN_W, F16, ASM)
    out = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] of y [M, N]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def run_inputs(in_features: int, group_size: int) -> int | None:
    """Inputs per run of the GEMV: the longest of 128, 64, 32 that both the row and a group
    split into evenly (None: the GEMV does not take the shape)."""
    for run in (128, 64, 32):
        if in_features % run == 0 and group_size % run == 0:
            return run
    return None


def dot_takes(in_features: int, group_size: int) -> bool:
    """Whether :func:`int4_dot_rows` and :func:`int4_planes` take this shape (runs of 128
    inputs)."""
    return in_features % DOT_RUN == 0 and group_size % DOT_RUN == 0


def _split_of(launch: Int4Launch, num_tiles: int, num_runs: int, device: torch.device, min_slice: int = 4) -> tuple[int, int]:
    """``(split_k, runs per split)`` with no empty split (``min_slice``: the fewest runs a
    chosen split leaves a slice)."""
    split = launch.split_k or choose_split(num_tiles, num_runs, num_sms(device), min_slice)
    runs_per_split = triton.cdiv(num_runs, max(1, min(split, num_runs)))
    return triton.cdiv(num_runs, runs_per_split), runs_per_split


def int4_gemv_unit(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=16, runs_per_chunk=4),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one contiguous row ``x`` ``[1, K]`` (``K`` in whole runs,
    :func:`run_inputs`), accumulated in float32, returned ``[1, N]`` in ``x``'s dtype."""
    n, kw = qweight.shape
    run = run_inputs(kw * PACK, group_size)
    assert run is not None, f"int4_gemv_unit takes inputs in whole runs of 32 within a group (K={kw * PACK}, group {group_size})"
    run_w = run // PACK
    num_runs = kw // run_w
    num_tiles = triton.cdiv(n, launch.block_n)
    split, runs_per_split = _split_of(launch, num_tiles, num_runs, x.device)
    num_sub = min(triton.next_power_of_2(runs_per_split), launch.runs_per_chunk * (128 // run))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemv_unit_kernel[(num_tiles, split)](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, partials, n,
        KW=kw, GROUP=group_size, RUN_W=run_w, RUNS_PER_SPLIT=runs_per_split, NUM_SUB=num_sub,
        BLOCK_N=launch.block_n, SPLIT=split > 1, HAS_BIAS=bias is not None, PREFETCH=launch.prefetch > 0,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return sum_splits(partials, bias, y) if split > 1 else y


def rows_words(in_features: int, group_size: int, num_warps: int) -> int | None:
    """Words per step of :func:`int4_gemv_rows` with ``num_warps`` (a 16-byte vector a thread),
    or None where it does not take the shape (inputs in blocks of 32, groups of whole words
    that the step holds a whole number of)."""
    block_w = 4 * 32 * num_warps
    if in_features % 32 or group_size % 32 or block_w % (group_size // PACK):
        return None
    return block_w


def x_planes(x: torch.Tensor) -> torch.Tensor:
    """One row ``x`` ``[1, K]`` (``K`` a multiple of 32) as float32 in plane order: per block of
    32 inputs (four words), ``[plane j][word i]`` holds input ``8 i + j``, so a plane of four
    adjacent words is one 16-byte load."""
    k = x.shape[-1]
    out = torch.empty(k // 32, 8, 4, dtype=torch.float32, device=x.device)
    out.copy_(x.reshape(k // 32, 4, 8).transpose(1, 2))
    return out.view(k)


def int4_gemv_rows(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=8),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for one contiguous row ``x`` ``[1, K]`` (:func:`rows_words` takes
    the shape), accumulated in float32, returned ``[1, N]`` in ``x``'s dtype; ``x`` is first
    copied in :func:`x_planes`' order."""
    n, kw = qweight.shape
    block_w = rows_words(kw * PACK, group_size, launch.num_warps)
    assert block_w is not None, f"int4_gemv_rows takes inputs in blocks of 32 and groups of whole steps (K={kw * PACK}, group {group_size})"
    num_tiles = triton.cdiv(n, launch.block_n)
    split, steps_per_split = _split_of(launch, num_tiles, triton.cdiv(kw, block_w), x.device, min_slice=1)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemv_rows_kernel[(num_tiles, split)](
        x_planes(x), qweight, scales, qzeros, bias if bias is not None else scales, y, partials, n,
        KW=kw, GROUP=group_size, WORDS_PER_SPLIT=steps_per_split * block_w, BLOCK_N=launch.block_n, BLOCK_W=block_w,
        SPLIT=split > 1, HAS_BIAS=bias is not None, ASM=x.is_cuda, num_warps=launch.num_warps, num_stages=1,
    )  # fmt: skip
    return sum_splits(partials, bias, y) if split > 1 else y


def int4_dot_rows(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=64, num_stages=3),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[M, K]``, ``M <= 16`` (rows of stride ``x.stride(0)``,
    inputs contiguous; :func:`dot_takes` the shape), accumulated in float32, returned
    ``[M, N]`` in ``x``'s dtype."""
    return _transposed_product(
        _int4_dot_rows_kernel, "int4_dot_rows", x, qweight, scales, qzeros, group_size, bias, launch, IEEE=x.dtype == torch.float32
    )


def int4_planes(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    launch: Int4Launch = Int4Launch(block_n=256, num_warps=8, num_stages=3),
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bfloat16 or float16 ``x`` ``[M, K]``, ``M <= 16`` (rows of
    stride ``x.stride(0)``, inputs contiguous; :func:`dot_takes` the shape; integer zero
    points), by the nibble-plane tensor-core product, accumulated in float32, returned
    ``[M, N]`` in ``x``'s dtype."""
    assert x.dtype in (torch.bfloat16, torch.float16), "int4_planes takes 16-bit activations"
    return _transposed_product(
        _int4_planes_kernel, "int4_planes", x, qweight, scales, qzeros, group_size, bias, launch,
        F16=x.dtype == torch.float16, ASM=x.is_cuda, RUNS_PER_ITER=launch.runs_per_chunk,
    )  # fmt: skip


def _transposed_product(
    kernel, name: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
    group_size: int, bias: torch.Tensor | None, launch: Int4Launch, **flags: bool,
) -> torch.Tensor:  # fmt: skip
    """One launch of a transposed tensor-core kernel here (and the split sum where the inputs
    are split); ``flags``: the kernel's own constexprs."""
    m, k = x.shape
    n, kw = qweight.shape
    assert m <= DOT_ROWS and dot_takes(k, group_size), f"{name} takes up to 16 rows and groups of 128 inputs"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    num_runs = kw // (DOT_RUN // PACK)
    num_tiles = triton.cdiv(n, launch.block_n)
    split, runs_per_split = _split_of(launch, num_tiles, num_runs, x.device)
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    kernel[(num_tiles, split)](
        x, qweight, scales, qzeros, bias if bias is not None else scales, y, partials, m, n, x.stride(0),
        KW=kw, GROUP=group_size, RUNS_PER_SPLIT=runs_per_split, BLOCK_M=DOT_ROWS, BLOCK_N=launch.block_n,
        SPLIT=split > 1, HAS_BIAS=bias is not None, num_warps=launch.num_warps, num_stages=launch.num_stages, **flags,
    )  # fmt: skip
    return sum_splits(partials, bias, y) if split > 1 else y
