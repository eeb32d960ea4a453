"""The LoRA shrink and expand products (``sonar.lora.ops``) for batches that mix adapters.

A layer's adapters are stacked by slot: ``a [S, N, in]`` (the A matrices of its fused parts,
``N = P * R``) and ``b [S, out, R]``; ``token_slots [T]`` names each token's slot (``-1``, or
anything outside ``[0, S)``: none).

Both kernels share one grid: token blocks of ``BLOCK_M`` and tiles of the product's columns
along axes 0 and 1 (the shrink) or 1 and 0 (the expand: programs launched together cover
whole rows of ``out``, long runs of memory, rather than one column tile of many rows), and
``G`` slot programs along axis 2, program ``j`` serving the slots
``j, j + G, j + 2G, ...``. A program loads its block's slots and leaves at once when none of
its tokens holds one of its slots; otherwise, for each of its slots that some token holds
(from the block's least to its greatest, so a block of one run checks one slot), it
multiplies that slot's weight tile by the block's rows of that slot (the others masked to
zero) in ``tl.dot`` steps, float32 accumulation. Rows of different slots are disjoint, so one
accumulator serves all of a program's slots. No program reads the weights of a slot its
tokens lack, and the host never reads ``token_slots`` (no sort, no counts): CUDA graphs
capture both launches, and the grid depends on the shapes alone.

- Prefill (more than ``DECODE_TOKENS`` tokens; long runs of one adapter): blocks of 64
  tokens and one slot program (``G = 1``), so a block inside a run reads one slot's weight
  tile once for all its tokens, as a segmented GEMM does, and a block across runs takes its
  few slots in turn.
- Decode (up to ``DECODE_TOKENS`` tokens, adapters mixed in any order): one block holds the
  whole batch and ``G = min(S, T)`` slot programs run side by side, so each adapter present is
  read once per step whatever the order of its tokens, and batch 1 launches no more programs
  than a plain product would.

:func:`lora_shrink` (``[T, in] -> [T, N]``, float32): the inputs are long and the outputs few,
so where the tiles alone are too few to fill the GPU the inputs are split among programs
(float32 partials ``[SPLIT_K, T, N]`` and one short sum: the same order every run, no
atomics). Tokens without a slot get zeros, written by slot program 0.

:func:`lora_shrink_begin` launches the shrink on a side stream, to run beside the base
layer's product: at decode sizes both are latency-bound, so the shrink's time mostly hides.

:func:`lora_expand` (``out[T, r0:r1] += y_p @ b[slot, r0:r1].T`` per part): one launch for all
of a fused layer's parts (up to ``MAX_PARTS``; tiles of ``BLOCK_N`` columns, each inside one
part), the rank in steps of at most 64 (padded to a power of two of at least 16 with masks),
``y`` rounded to the weights' dtype as the torch version does, and ``out`` read (first: its
latency hides behind the product), added to in float32 and written back only for the
program's own tokens: rows without a slot stay as they were.

:func:`lora_shrink_expand` (both in one launch, up to ``FUSED_TOKENS`` tokens): at batch 1
the two launches (three with the shrink's split sum), not the bytes, cost the time, so one
grid of column tiles (all parts, as the expand's) and slot programs does both: each program
computes its part's rank-``R`` intermediate of the batch over all the inputs itself (a part's
A, ``R x in``, is read from L2 by every program of that part, so tiles are as wide as keeps
those reads within ``FUSED_A_READS``; see :func:`fused_launch`), keeps it in float32 (split
into two values of the weights' dtype for the tensor-core product with B), and adds its tile
to ``out``, rounding once. The tile of ``out`` is loaded first, so its latency hides behind
the products.

Launches: ``LoRALaunch``; :func:`shrink_launch`, :func:`expand_launch` and
:func:`fused_launch` choose them from the shapes (``sonar-cuda/benchmarks/lora_kernels.py
--sweep`` measures the alternatives).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar_cuda.kernels.splitk import num_sms, sum_splits

DECODE_TOKENS = 64  # up to this many tokens, one block holds the whole batch
MAX_PARTS = 4  # fused parts per expand launch (qkv: 3, gate_up: 2)
MAX_SPLIT = 32
WAVES = 2  # programs the shrink's split aims at, per multiprocessor
# up to this many tokens, lora_shrink_expand runs as one fused launch: 0 (off) since, in the
# engine on the H200 (Llama-3.1-8B, rank 16, batch 1), the untuned fused kernel gave a TPOT of
# 1.40x the base's against 1.28x for the two launches; lora_serving.py --fused-tokens measures it
FUSED_TOKENS = 0
# up to this many tokens the shrink runs on a side stream beside the base product
# (lora_shrink_begin); past it the base product is long and the shrink's share small
OVERLAP_TOKENS = DECODE_TOKENS
FUSED_A_READS = 16 << 20  # bytes of A the fused launch's programs read from L2, together, at most


@dataclass(frozen=True, slots=True)
class LoRALaunch:
    """How a launch covers its product: tokens per block, columns per tile, inputs (shrink,
    fused) or ranks (expand) per ``tl.dot`` step, split-K factor (shrink; 0: chosen from the
    shape), slot programs per block and tile (0: chosen), warps, pipeline stages, and ranks
    per step of the fused launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 0
    slot_programs: int = 0
    num_warps: int = 4
    num_stages: int = 3
    block_r: int = 0  # ranks per step of the fused launch (0: chosen from the rank)


def block_m_for(num_tokens: int) -> int:
    """Tokens per block: the whole batch up to ``DECODE_TOKENS`` (at least 16, ``tl.dot``'s
    smallest), else 64."""
    return max(16, min(triton.next_power_of_2(max(num_tokens, 1)), DECODE_TOKENS))


def slot_programs_for(num_tokens: int, num_slots: int, launch: LoRALaunch) -> int:
    """Slot programs per block and tile: the launch's, else ``min(S, T)`` in decode (every
    adapter of the batch side by side) and 1 in prefill (a block's few slots in turn)."""
    if launch.slot_programs > 0:
        return min(launch.slot_programs, num_slots)
    return min(num_slots, num_tokens) if num_tokens <= DECODE_TOKENS else 1


def shrink_launch(num_tokens: int, n: int, dtype: torch.dtype) -> LoRALaunch:
    """The shrink's launch: decode takes 16-column tiles (many small programs to stream the
    few A rows), prefill tiles of up to 64 columns; steps of 256 (decode) or 128 inputs of
    2-byte values, half that of float32."""
    scale = 2 if dtype.itemsize > 2 else 1
    if num_tokens <= DECODE_TOKENS:
        return LoRALaunch(block_m_for(num_tokens), 16, 256 // scale)
    return LoRALaunch(64, min(64, max(16, triton.next_power_of_2(n))), 128 // scale)


def expand_launch(num_tokens: int, rank: int) -> LoRALaunch:
    """The expand's launch: the rank in one step up to 64, 64 output columns per tile at up
    to 16 tokens, 128 beyond."""
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    return LoRALaunch(block_m_for(num_tokens), 64 if num_tokens <= 16 else 128, block_r)


def fused_launch(
    num_out: int, k: int, rank: int, num_tokens: int, num_slots: int, dtype: torch.dtype, device: torch.device
) -> LoRALaunch:
    """The fused launch's (``num_out`` rows over all parts, ``k`` inputs): every program
    reads its part's whole A (``rank x k``) of its slot from L2, so tiles are as narrow as
    fills the multiprocessors once while those reads stay under ``FUSED_A_READS`` together,
    for each of the ``min(S, T)`` slot programs (32 to 512 columns; at batch 1 qkv runs 96
    programs, o 128, gate_up 112, down 32); steps of 512 inputs of 2-byte values, half that
    of float32 (a program's time is its A read, latency-bound: the wider the step, the more
    of A is in flight)."""
    a_bytes = max(1, rank * k * dtype.itemsize)
    slot_programs = max(1, min(num_slots, num_tokens))
    programs = max(1, min(num_sms(device), FUSED_A_READS // a_bytes) // slot_programs)
    block_n = min(512, max(32, triton.next_power_of_2(triton.cdiv(max(num_out, 1), programs))))
    block_m = block_m_for(num_tokens)
    # x's [block_m, block_k] tiles, three stages deep, must fit in shared memory (a 64-token
    # block at 512 inputs would ask 256 KiB of the H200's 227)
    block_k = (512 if block_m <= 16 else 128) // (2 if dtype.itemsize > 2 else 1)
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    warps = 8 if block_n >= 256 else 4
    return LoRALaunch(block_m, block_n, block_k, num_warps=warps, num_stages=3, block_r=block_r)


def shrink_split(num_busy: int, k: int, launch: LoRALaunch, device: torch.device) -> tuple[int, int]:
    """``(SPLIT_K, inputs per split)`` of a shrink whose unsplit grid has ``num_busy``
    programs with work: enough programs for ``WAVES`` per multiprocessor, each split a whole
    number of ``block_k`` steps (the launch's factor where it names one)."""
    num_steps = triton.cdiv(k, launch.block_k)
    split = launch.split_k
    if split <= 0:
        split = min(MAX_SPLIT, triton.cdiv(WAVES * num_sms(device), max(1, num_busy)))
    steps_per_split = triton.cdiv(num_steps, max(1, min(split, num_steps)))
    return triton.cdiv(num_steps, steps_per_split), steps_per_split * launch.block_k


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, y_ptr,
    T, N, K, num_slots, slot_programs, k_per_split, num_tiles,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_ys, stride_yt, stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid_tile = tl.program_id(1)
    tile, split = pid_tile % num_tiles, pid_tile // num_tiles
    first_slot = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_slots = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    has_slot = (token_slots >= 0) & (token_slots < num_slots)
    mine = has_slot & (token_slots % slot_programs == first_slot)
    # slot program 0 also writes the zeros of tokens without a slot
    write = mine | ((offs_m < T) & ~has_slot & (first_slot == 0))
    if tl.max(write.to(tl.int32), axis=0) == 0:
        return
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + offs_n.to(tl.int64)[:, None] * stride_an
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lowest, highest = tl.min(tl.where(mine, token_slots, num_slots), axis=0), tl.max(tl.where(mine, token_slots, -1), axis=0)
    for slot in range(lowest, highest + 1, slot_programs):  # all congruent to first_slot
        own = token_slots == slot
        if tl.max(own.to(tl.int32), axis=0) > 0:
            a_slot = a_rows + slot * stride_as  # below 2^31: S * N * in elements
            for k0 in range(k_start, k_end, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < k_end
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=own[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                a = tl.load(a_slot + k[None, :] * stride_ak, mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
                if IEEE:
                    acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(a.to(x.dtype)))
    y_ptrs = y_ptr + split * stride_ys + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc, mask=write[:, None] & n_mask[None, :])


@triton.jit
def _part_of(pid, tile0, y_col, r0, r1, P_TILE, P_Y, P_R0, P_R1):
    """The next part (column tiles from ``P_TILE``, ``y`` columns from ``P_Y``, rows
    ``P_R0:P_R1``) where ``pid`` is one of its tiles, else the part so far."""
    inside = pid >= P_TILE
    return (
        tl.where(inside, P_TILE, tile0),
        tl.where(inside, P_Y, y_col),
        tl.where(inside, P_R0, r0),
        tl.where(inside, P_R1, r1),
    )


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, slots_ptr, out_ptr,
    T, R, num_slots, slot_programs,
    stride_yt, stride_yn, stride_bs, stride_bo, stride_br, stride_ot, stride_oo,
    P0_Y, P0_R0, P0_R1, P1_TILE, P1_Y, P1_R0, P1_R1,
    P2_TILE, P2_Y, P2_R0, P2_R1, P3_TILE, P3_Y, P3_R0, P3_R1,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    first_slot = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    token_slots = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    mine = (token_slots >= 0) & (token_slots < num_slots) & (token_slots % slot_programs == first_slot)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    # the part of this column tile: part i's tiles start at tile Pi_TILE (part 0's at 0)
    pid = tl.program_id(0)
    tile0, y_col, r0, r1 = 0, P0_Y, P0_R0, P0_R1
    if NUM_PARTS > 1:
        tile0, y_col, r0, r1 = _part_of(pid, tile0, y_col, r0, r1, P1_TILE, P1_Y, P1_R0, P1_R1)
    if NUM_PARTS > 2:
        tile0, y_col, r0, r1 = _part_of(pid, tile0, y_col, r0, r1, P2_TILE, P2_Y, P2_R0, P2_R1)
    if NUM_PARTS > 3:
        tile0, y_col, r0, r1 = _part_of(pid, tile0, y_col, r0, r1, P3_TILE, P3_Y, P3_R0, P3_R1)
    offs_o = r0 + (pid - tile0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_mask = offs_o < r1
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_o[None, :] * stride_oo
    mask = mine[:, None] & o_mask[None, :]
    old = tl.load(out_ptrs, mask=mask, other=0.0)  # issued first: its latency hides behind the product
    offs_r = tl.arange(0, BLOCK_R)
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + y_col * stride_yn
    b_cols = b_ptr + offs_o.to(tl.int64)[None, :] * stride_bo
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lowest, highest = tl.min(tl.where(mine, token_slots, num_slots), axis=0), tl.max(tl.where(mine, token_slots, -1), axis=0)
    for slot in range(lowest, highest + 1, slot_programs):  # all congruent to first_slot
        own = token_slots == slot
        if tl.max(own.to(tl.int32), axis=0) > 0:
            b_slot = b_cols + slot * stride_bs  # below 2^31: S * out * R elements
            for rank0 in range(0, R, BLOCK_R):
                r = rank0 + offs_r
                r_mask = r < R
                b = tl.load(b_slot + r[:, None] * stride_br, mask=r_mask[:, None] & o_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                y = tl.load(y_rows + r[None, :] * stride_yn, mask=own[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
                if IEEE:
                    acc += tl.dot(y.to(b.dtype), b, input_precision="ieee")
                else:
                    acc += tl.dot(y.to(b.dtype), b)
    tl.store(out_ptrs, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_fused_kernel(
    x_ptr, a_ptr, b_ptr, slots_ptr, out_ptr,
    T, K, R, num_slots, slot_programs,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_bs, stride_bo, stride_br, stride_ot, stride_oo,
    P0_Y, P0_R0, P0_R1, P1_TILE, P1_Y, P1_R0, P1_R1,
    P2_TILE, P2_Y, P2_R0, P2_R1, P3_TILE, P3_Y, P3_R0, P3_R1,
    NUM_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    first_slot = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)  # the whole batch: one block
    token_slots = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    mine = (token_slots >= 0) & (token_slots < num_slots) & (token_slots % slot_programs == first_slot)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    pid = tl.program_id(0)
    tile0, a_row, r0, r1 = 0, P0_Y, P0_R0, P0_R1
    if NUM_PARTS > 1:
        tile0, a_row, r0, r1 = _part_of(pid, tile0, a_row, r0, r1, P1_TILE, P1_Y, P1_R0, P1_R1)
    if NUM_PARTS > 2:
        tile0, a_row, r0, r1 = _part_of(pid, tile0, a_row, r0, r1, P2_TILE, P2_Y, P2_R0, P2_R1)
    if NUM_PARTS > 3:
        tile0, a_row, r0, r1 = _part_of(pid, tile0, a_row, r0, r1, P3_TILE, P3_Y, P3_R0, P3_R1)
    offs_o = r0 + (pid - tile0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_mask = offs_o < r1
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_o[None, :] * stride_oo
    mask = mine[:, None] & o_mask[None, :]
    old = tl.load(out_ptrs, mask=mask, other=0.0)  # issued first: its latency hides behind the products
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    b_cols = b_ptr + offs_o.to(tl.int64)[None, :] * stride_bo
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lowest, highest = tl.min(tl.where(mine, token_slots, num_slots), axis=0), tl.max(tl.where(mine, token_slots, -1), axis=0)
    for slot in range(lowest, highest + 1, slot_programs):  # all congruent to first_slot
        own = token_slots == slot
        if tl.max(own.to(tl.int32), axis=0) > 0:
            a_slot = a_ptr + slot * stride_as  # below 2^31: S * N * in elements
            b_slot = b_cols + slot * stride_bs
            for rank0 in range(0, R, BLOCK_R):
                r = rank0 + offs_r
                r_mask = r < R
                a_rows = a_slot + (a_row + r).to(tl.int64)[:, None] * stride_an
                # B's tile first (in flight during the inputs' loop), then this part's rank-R
                # intermediate of the block's rows, over all the inputs
                b = tl.load(b_slot + r[:, None] * stride_br, mask=r_mask[:, None] & o_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                y = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + offs_k
                    k_mask = k < K
                    x = tl.load(x_rows + k[None, :] * stride_xk, mask=own[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                    a = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
                    if IEEE:
                        y += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision="ieee")
                    else:
                        y += tl.dot(x, tl.trans(a.to(x.dtype)))
                if IEEE:
                    acc += tl.dot(y, b.to(tl.float32), input_precision="ieee")
                else:
                    # y as the sum of two values of b's dtype: the product keeps y's float32
                    # precision to about 2^-16 instead of rounding it to 8 bits
                    y_hi = y.to(b.dtype)
                    y_lo = (y - y_hi.to(tl.float32)).to(b.dtype)
                    acc += tl.dot(y_hi, b)
                    acc += tl.dot(y_lo, b)
    tl.store(out_ptrs, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _check_slots(token_slots: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if token_slots.shape != (num_tokens,) or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"token_slots must be an int32 tensor of shape ({num_tokens},), got {token_slots.dtype} of shape {tuple(token_slots.shape)}"
        )
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, the activations on {device}")


def _check_parts(part_rows: tuple[tuple[int, int], ...], num_out: int) -> None:
    for r0, r1 in part_rows:
        if not 0 <= r0 <= r1 <= num_out:
            raise ValueError(f"part rows ({r0}, {r1}) outside the {num_out} rows of b")
    spans = sorted((r0, r1) for r0, r1 in part_rows if r1 > r0)
    for (r0, r1), (next0, next1) in itertools.pairwise(spans):
        if next0 < r1:  # one launch adds all parts: rows of two parts would race
            raise ValueError(f"part rows ({r0}, {r1}) and ({next0}, {next1}) overlap; each output row belongs to one part")


def _part_groups(part_rows: tuple[tuple[int, int], ...], rank: int, block_n: int):
    """Per launch (up to ``MAX_PARTS`` non-empty parts each): ``(parts, column tiles, part
    arguments)``, the arguments ``P0_Y, P0_R0, P0_R1, P1_TILE, P1_Y, ...`` where part ``i``'s
    tiles start at tile ``Pi_TILE``, its rank columns (of ``y``, or rows of ``a``) at ``Pi_Y``,
    its rows of ``out`` are ``Pi_R0:Pi_R1``; unused parts start past the last tile."""
    parts = [(p * rank, r0, r1) for p, (r0, r1) in enumerate(part_rows) if r1 > r0]
    for first in range(0, len(parts), MAX_PARTS):
        group = parts[first : first + MAX_PARTS]
        tiles = [0]
        for _, r0, r1 in group:
            tiles.append(tiles[-1] + triton.cdiv(r1 - r0, block_n))
        part_args: list[int] = []
        for i in range(MAX_PARTS):
            part_args += [tiles[i], *group[i]] if i < len(group) else [tiles[-1], 0, 0, 0]
        yield len(group), tiles[-1], part_args[1:]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, launch: LoRALaunch | None = None) -> torch.Tensor:
    """``y[t] = x[t] @ a[token_slots[t]].T`` for ``x [T, in]`` and ``a [S, N, in]`` (floating,
    any strides): ``[T, N]`` float32, zero for tokens without a slot (``launch``: for tuning)."""
    shrink = _ShrinkLaunch(x, a, token_slots, launch)
    shrink.run()
    return shrink.y


def lora_shrink_begin(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """:func:`lora_shrink` launched on a side stream, so that it runs while the base layer's
    product (launched next on the current stream) does: at decode sizes both are short and
    latency-bound, and the shrink reads only ``x`` and a few hundred kilobytes of A. Returns
    the function that makes the current stream wait for the shrink and gives its ``y``; None
    past ``OVERLAP_TOKENS`` tokens and off CUDA (Triton's interpreter): the caller then
    shrinks after the product. CUDA graphs capture the fork and the join."""
    if x.shape[0] > OVERLAP_TOKENS or x.device.type != "cuda":
        return None
    shrink = _ShrinkLaunch(x, a, token_slots, None)  # buffers from the current stream: used on it after the join
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)  # x is ready
    with torch.cuda.stream(side):
        shrink.run()

    def join() -> torch.Tensor:
        main.wait_stream(side)
        return shrink.y

    return join


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class _ShrinkLaunch:
    """One shrink's checked shapes, its launch and its output buffers (``y``, and the split
    partials where the inputs are split), allocated on the stream current at construction."""

    def __init__(self, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, launch: LoRALaunch | None) -> None:
        if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
            raise ValueError(f"lora_shrink takes x [T, in] and a [S, N, in]; got x {tuple(x.shape)} and a {tuple(a.shape)}")
        if a.device != x.device:
            raise ValueError(f"the adapters' A weights are on {a.device}, the activations on {x.device}")
        num_tokens, k = x.shape
        num_slots, n = a.shape[0], a.shape[1]
        _check_slots(token_slots, num_tokens, x.device)
        self.x, self.a, self.token_slots = x, a, token_slots
        self.empty = num_tokens == 0 or n == 0 or num_slots == 0 or k == 0
        if self.empty:
            self.y = torch.zeros(num_tokens, n, dtype=torch.float32, device=x.device)
            return
        self.launch = launch = launch or shrink_launch(num_tokens, n, x.dtype)
        self.num_blocks, self.num_tiles = triton.cdiv(num_tokens, launch.block_m), triton.cdiv(n, launch.block_n)
        self.slot_programs = slot_programs_for(num_tokens, num_slots, launch)
        busy = self.num_blocks * self.num_tiles * self.slot_programs
        self.split, self.k_per_split = shrink_split(busy, k, launch, x.device)
        self.y = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
        self.partials = torch.empty(self.split, num_tokens, n, dtype=torch.float32, device=x.device) if self.split > 1 else self.y.unsqueeze(0)

    def run(self) -> None:
        if self.empty:
            return
        x, a, launch, partials = self.x, self.a, self.launch, self.partials
        (num_tokens, k), (num_slots, n) = x.shape, a.shape[:2]
        _lora_shrink_kernel[(self.num_blocks, self.num_tiles * self.split, self.slot_programs)](
            x, a, self.token_slots, partials,
            num_tokens, n, k, num_slots, self.slot_programs, self.k_per_split, self.num_tiles,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
            partials.stride(0), partials.stride(1), partials.stride(2),
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
            IEEE=x.dtype == torch.float32, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )  # fmt: skip
        if self.split > 1:
            sum_splits(partials, None, self.y)


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    part_rows: tuple[tuple[int, int], ...],
    launch: LoRALaunch | None = None,
) -> torch.Tensor:
    """``out[t, r0:r1] += y[t, p*R:(p+1)*R] @ b[token_slots[t], r0:r1].T`` for every part
    ``p`` with rows ``part_rows[p] = (r0, r1)`` (``R = b.shape[-1]``), in place, in ``out``'s
    dtype; tokens without a slot are left as they are. Returns ``out`` (``launch``: for tuning)."""
    if y.dim() != 2 or b.dim() != 3 or out.dim() != 2 or out.shape[0] != y.shape[0] or out.shape[1] != b.shape[1]:
        raise ValueError(
            f"lora_expand takes y [T, N], b [S, out, R] and out [T, out]; got y {tuple(y.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}"
        )
    if b.device != out.device or y.device != out.device:
        raise ValueError(f"y ({y.device}), b ({b.device}) and out ({out.device}) must be on one device")
    num_tokens, (num_slots, num_out, rank) = y.shape[0], b.shape
    if y.shape[1] < len(part_rows) * rank:
        raise ValueError(f"y has {y.shape[1]} columns; {len(part_rows)} parts of rank {rank} need {len(part_rows) * rank}")
    _check_parts(part_rows, num_out)
    _check_slots(token_slots, num_tokens, out.device)
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return out
    launch = launch or expand_launch(num_tokens, rank)
    num_blocks = triton.cdiv(num_tokens, launch.block_m)
    slot_programs = slot_programs_for(num_tokens, num_slots, launch)
    for num_parts, num_tiles, part_args in _part_groups(part_rows, rank, launch.block_n):
        _lora_expand_kernel[(num_tiles, num_blocks, slot_programs)](
            y, b, token_slots, out,
            num_tokens, rank, num_slots, slot_programs,
            y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
            *part_args,
            NUM_PARTS=num_parts, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_R=launch.block_k,
            IEEE=b.dtype == torch.float32, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )  # fmt: skip
    return out


def lora_shrink_expand(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    part_rows: tuple[tuple[int, int], ...],
    launch: LoRALaunch | None = None,
) -> torch.Tensor:
    """``out[t, r0:r1] += (x[t] @ a[slot, p*R:(p+1)*R].T) @ b[slot, r0:r1].T`` with
    ``slot = token_slots[t]``, for every part ``p`` with rows ``part_rows[p] = (r0, r1)``, in
    place; tokens without a slot are left as they are. Returns ``out``.

    Up to ``FUSED_TOKENS`` tokens (up to ``DECODE_TOKENS`` where ``launch`` is given: for
    measuring) in one launch: each program computes its part's rank-``R`` intermediate
    itself, float32 throughout, and adds its tile of columns to ``out`` rounding once; more
    tokens: :func:`lora_shrink` then :func:`lora_expand`."""
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or out.dim() != 2:
        raise ValueError(
            f"lora_shrink_expand takes x [T, in], a [S, N, in], b [S, out, R] and out [T, out]; "
            f"got x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}"
        )
    num_tokens, k = x.shape
    num_slots, num_out, rank = b.shape
    if a.shape[0] != num_slots or a.shape[2] != k or out.shape != (num_tokens, num_out):
        raise ValueError(
            f"lora_shrink_expand takes x [T, in], a [S, N, in], b [S, out, R] and out [T, out]; "
            f"got x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}"
        )
    if len({x.device, a.device, b.device, out.device}) > 1:
        raise ValueError(f"x ({x.device}), a ({a.device}), b ({b.device}) and out ({out.device}) must be on one device")
    if a.shape[1] < len(part_rows) * rank:
        raise ValueError(f"a has {a.shape[1]} rows; {len(part_rows)} parts of rank {rank} need {len(part_rows) * rank}")
    _check_parts(part_rows, num_out)
    _check_slots(token_slots, num_tokens, out.device)
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return out
    if launch is None and num_tokens > FUSED_TOKENS:
        return lora_expand(lora_shrink(x, a, token_slots), b, token_slots, out, part_rows)
    if num_tokens > DECODE_TOKENS:
        raise ValueError(f"the fused launch takes up to {DECODE_TOKENS} tokens (one block), got {num_tokens}")
    if k == 0:
        return out
    launch = launch or fused_launch(num_out, k, rank, num_tokens, num_slots, x.dtype, x.device)
    block_m = max(launch.block_m, block_m_for(num_tokens))  # one block holds the whole batch
    block_r = launch.block_r or min(64, max(16, triton.next_power_of_2(rank)))
    slot_programs = slot_programs_for(num_tokens, num_slots, launch)
    for num_parts, num_tiles, part_args in _part_groups(part_rows, rank, launch.block_n):
        _lora_fused_kernel[(num_tiles, slot_programs)](
            x, a, b, token_slots, out,
            num_tokens, k, rank, num_slots, slot_programs,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
            b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
            *part_args,
            NUM_PARTS=num_parts, BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_R=block_r,
            IEEE=x.dtype == torch.float32, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )  # fmt: skip
    return out
