"""The experts of a mixture-of-experts layer (``sonar.moe.fused_moe``) as two grouped GEMMs.

``T`` tokens each chose ``k`` experts, so there are ``T * k`` (token, expert) pairs; pair
``p`` is token ``p // k``'s ``p % k``-th choice. The launch:

1. :func:`align_by_expert` groups the pairs by expert (in pair order) and pads each expert's
   run to a multiple of ``BLOCK_M``: ``sorted_pairs`` (padding holds ``T * k``, no pair) and,
   per block of ``BLOCK_M`` entries, its expert (``E`` past the last run: nothing to do). Up
   to ``ALIGN_KERNEL_MAX_PAIRS`` pairs (decode batches) it is one single-program Triton launch
   (a histogram, a prefix sum, each pair placed after the earlier pairs of its expert); more
   pairs take a device sort in torch. Both are sized from the shapes alone (at most
   ``min(E, T * k)`` runs are padded), so the host reads nothing and CUDA graphs capture them.
2. Gate/up: each program takes one block (one expert) and ``BLOCK_N`` columns of the
   intermediate size, gathers its tokens' rows of ``x``, multiplies them by the expert's gate
   and up tiles (two float32 accumulators, one pass over ``x``), and writes
   ``silu(gate) * up`` for its pairs: ``[T * k, I]``.
3. Down: the same blocks over ``w2``; the float32 product is multiplied by the pair's routing
   weight and written per pair, ``[T * k, H]``; a sum over the ``k`` pairs of each token gives
   the output (no atomics: the same order every run).

Under expert parallelism (``expert_map``, see ``sonar.moe``) the routing is first mapped to this
rank's experts on the device; a pair whose expert another rank holds gets id ``E`` and is
placed in no block, and its row of the output stays zero.

Each expert's weight tiles are read once per block of its tokens: at decode (a few tokens per
expert) a step reads the weights of the experts it touches, about once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sonar.moe import check_moe_shapes, local_expert_ids


# the single-program alignment kernel's reach (beyond it: a device sort, a dozen launches)
ALIGN_KERNEL_MAX_PAIRS = 1024  # 128 tokens at top 8; benchmarks/moe.py times both ways
ALIGN_KERNEL_MAX_BINS = 512


@dataclass(frozen=True, slots=True)
class MoELaunch:
    """Pairs per block, columns per tile, inputs per ``tl.dot`` step, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def launch_for(num_pairs: int, num_experts: int, device: torch.device) -> MoELaunch:
    """The launch for ``num_pairs`` (token, expert) pairs over ``num_experts`` experts: blocks of
    16 pairs while experts see few tokens each (decode), larger blocks as the runs grow."""
    if device.type != "cuda":  # Triton's interpreter: small tiles keep it quick
        return MoELaunch(block_m=16, block_n=64, block_k=64, num_warps=1, num_stages=1)
    pairs_per_expert = num_pairs / max(num_experts, 1)
    if pairs_per_expert <= 16:
        return MoELaunch(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if pairs_per_expert <= 64:
        return MoELaunch(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoELaunch(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [num_blocks * block_m] int32, block_experts [num_blocks] int32)``.

    The pairs of each expert are contiguous, in pair order, each expert's run padded with
    ``T * k`` to a multiple of ``block_m``; ``block_experts[b]`` is the expert of block ``b``
    (``num_experts`` for blocks past the last run). A pair of id ``num_experts`` (its expert
    is held by another rank) is placed in no run. No host synchronisation: up to
    ``ALIGN_KERNEL_MAX_PAIRS`` pairs (decode) in one Triton launch, more with a device sort.
    """
    num_pairs = topk_ids.numel()
    max_runs = min(num_experts, num_pairs)
    num_blocks = triton.cdiv(num_pairs + max_runs * (block_m - 1), block_m)
    bins = triton.next_power_of_2(num_experts + 1)  # one more bin: masked-off pairs land there
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS and bins <= ALIGN_KERNEL_MAX_BINS:
        flat = topk_ids.reshape(-1)
        sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
        block_experts = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
        _align_kernel[(1,)](
            flat, sorted_pairs, block_experts, num_pairs, num_blocks,
            NUM_EXPERTS=num_experts, BINS=bins, BLOCK_M=block_m, CHUNK=32, num_warps=4,
        )  # fmt: skip
        return sorted_pairs, block_experts
    return _align_by_sorting(topk_ids, num_experts, block_m, num_blocks)


def _align_by_sorting(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    # the last bin: pairs whose expert another rank holds (sorted last, given no run)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # on the device: no host value copied in (CUDA graphs capture this)
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # where each expert's pairs start, unpadded
    experts_sorted, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=device) - run_start[experts_sorted]
    dest = padded_end[experts_sorted] - padded[experts_sorted] + rank
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    placed = torch.where(experts_sorted < num_experts, order, num_pairs)  # past the runs: padding
    sorted_pairs.scatter_(0, dest, placed.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_experts = torch.searchsorted(padded_end[:num_experts], block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _align_kernel(
    ids_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,  # a power of two > NUM_EXPERTS
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    # one program: count the pairs per expert, lay the padded runs out, then place each pair
    # at its run's start plus the number of earlier pairs of its expert (pair order kept)
    bins = tl.arange(0, BINS)
    is_expert = bins < NUM_EXPERTS
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        experts = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=NUM_EXPERTS).to(tl.int32)
        counts += tl.histogram(experts, BINS)
    counts = tl.where(is_expert, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    # each block's expert: the number of runs that end at or before the block's first entry
    for block0 in range(0, num_blocks, CHUNK):
        blocks = block0 + tl.arange(0, CHUNK)
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & is_expert[None, :]  # [CHUNK, BINS]
        tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int32), axis=1), mask=blocks < num_blocks)
    for pos0 in range(0, num_blocks * BLOCK_M, CHUNK):  # padding everywhere first
        pos = pos0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + pos, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=pos < num_blocks * BLOCK_M)
    tl.debug_barrier()
    placed = tl.zeros([BINS], dtype=tl.int32)  # pairs of each expert placed so far
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        experts = tl.load(ids_ptr + offs, mask=mask, other=NUM_EXPERTS).to(tl.int32)
        onehot = (experts[:, None] == bins[None, :]).to(tl.int32)  # [CHUNK, BINS]
        earlier = tl.cumsum(onehot, 0) - onehot + placed[None, :]
        dest = tl.sum(onehot * (starts[None, :] + earlier), axis=1)
        tl.store(sorted_pairs_ptr + dest, offs.to(tl.int32), mask=mask & (experts < NUM_EXPERTS))
        placed += tl.sum(onehot, axis=0)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr, scale_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk, up_scales,
    A_ROWS_PER_PAIR: tl.constexpr,  # k: a row of x per token; 1: a row of the intermediate per pair
    NUM_EXPERTS: tl.constexpr,
    GATED: tl.constexpr,  # gate rows [0, N) and up rows [N, 2N): write silu(gate) * up
    WEIGHTED: tl.constexpr,  # multiply each pair's row by its routing weight
    SCALED: tl.constexpr,  # FP8 weights: each tile widened to the activations' dtype, each output column times its row's scale
    SCALE_BLOCK_N: tl.constexpr,  # with SCALED: 0, a scale per row; else one per block of (rows, inputs),
    SCALE_BLOCK_K: tl.constexpr,  # applied to each weight tile (BLOCK_K divides SCALE_BLOCK_K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    a_rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_row = scale_ptr + expert.to(tl.int64) * stride_se
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if SCALED:
            if SCALE_BLOCK_N > 0:  # the tile's columns each in their block of rows, one block of inputs
                block_scales = scale_row + (k0 // SCALE_BLOCK_K) * stride_sk
                s = tl.load(block_scales + (cols // SCALE_BLOCK_N) * stride_sn, mask=col_mask, other=0.0)
                w = (w.to(tl.float32) * s[None, :]).to(a.dtype)
            else:
                w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(up_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if SCALED:
                if SCALE_BLOCK_N > 0:
                    s_up = tl.load(block_scales + (up_scales + cols // SCALE_BLOCK_N) * stride_sn, mask=col_mask, other=0.0)
                    w_up = (w_up.to(tl.float32) * s_up[None, :]).to(a.dtype)
                else:
                    w_up = w_up.to(a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALED and SCALE_BLOCK_N == 0:
        acc = acc * tl.load(scale_row + cols, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_row + N + cols, mask=col_mask, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor, top_k: int, gated: bool, launch: MoELaunch, scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    num_pairs, n = out.shape
    k = a.shape[1]
    grid = (block_experts.shape[0], triton.cdiv(n, launch.block_n))
    blocked = scale is not None and block is not None
    # where the up rows' scales start: row n of a scale per row, block row ceil(n / bn) of blocks
    up_scales = -(-n // block[0]) if blocked else n
    _moe_gemm_kernel[grid](
        a, w, out, weights, sorted_pairs, block_experts, scale if scale is not None else weights,
        num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), scale.stride(0) if scale is not None else 0,
        scale.stride(1) if blocked else 0, scale.stride(2) if blocked else 0, up_scales,
        A_ROWS_PER_PAIR=top_k if gated else 1,
        NUM_EXPERTS=w.shape[0],
        GATED=gated,
        WEIGHTED=not gated,
        SCALED=scale is not None,
        SCALE_BLOCK_N=block[0] if blocked else 0,
        SCALE_BLOCK_K=block[1] if blocked else 0,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    launch: MoELaunch | None = None, expert_map: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``sonar.moe.fused_moe`` in two Triton launches (after the device-side sort): ``[T, H]``
    in ``x``'s dtype. ``launch`` overrides :func:`launch_for` (benchmarks sweep it);
    ``expert_map`` (global expert id -> index into ``w13`` / ``w2``, -1: held elsewhere) as
    ``sonar.moe.fused_moe`` takes it."""
    return _fused_moe(x, w13, w2, None, None, topk_weights, topk_ids, launch, expert_map)


def fused_moe_fp8(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None, launch: MoELaunch | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``sonar.moe.fused_moe_fp8``: :func:`fused_moe` over FP8 weights, each output row of an
    expert's projection times its scale (``w13_scale [E, 2I]``, ``w2_scale [E, H]``, float32),
    or with ``block`` ``(bn, bk)`` each block of its weight times its scale (``w13_scale
    [E, 2 ceil(I / bn), ceil(H / bk)]``: the gate's block rows, then the up's; ``w2_scale
    [E, ceil(H / bn), ceil(I / bk)]``), each weight tile scaled as it is read; the activations
    stay in ``x``'s dtype (W8A16)."""
    if block is not None:
        hidden, intermediate = x.shape[1], w2.shape[2]
        expected = ((-(-intermediate // block[0]) * 2, -(-hidden // block[1])), (-(-hidden // block[0]), -(-intermediate // block[1])))
        if (tuple(w13_scale.shape[1:]), tuple(w2_scale.shape[1:])) != expected:
            raise ValueError(f"block scales {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)} do not fit {block} blocks of these experts")
        launch = launch or launch_for(topk_ids.numel(), w13.shape[0], x.device)
        block_k = math.gcd(launch.block_k, block[1])  # a weight tile within one block of inputs
        if block_k < 16:
            raise ValueError(f"blocks of {block[1]} inputs leave tiles of {block_k}; the kernel's dot needs 16")
        launch = replace(launch, block_k=block_k)
    return _fused_moe(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, launch, expert_map, block)


def _fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, launch: MoELaunch | None, expert_map: torch.Tensor | None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    check_moe_shapes(x, w13, w2, topk_weights, topk_ids, expert_map)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    num_pairs = num_tokens * top_k
    launch = launch or launch_for(num_pairs, num_experts, x.device)
    sorted_pairs, block_experts = align_by_expert(local_expert_ids(topk_ids, expert_map, num_experts), num_experts, launch.block_m)
    weights = topk_weights.reshape(-1).contiguous()
    intermediate = x.new_empty((num_pairs, two_i // 2))
    _grouped_gemm(x, w13, intermediate, weights, sorted_pairs, block_experts, top_k, True, launch, w13_scale, block)
    # pairs of experts held elsewhere are written by no block: their rows must be zero
    per_pair = x.new_empty((num_pairs, hidden)) if expert_map is None else x.new_zeros((num_pairs, hidden))
    _grouped_gemm(intermediate, w2, per_pair, weights, sorted_pairs, block_experts, top_k, False, launch, w2_scale, block)
    if top_k == 1:
        return per_pair
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)  # float32 accumulation, one launch


def loop_over_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The baseline the fused kernel is measured against, as transformers runs experts: the
    (token, slot) pairs sorted by expert once, the per-expert counts read on the host once, then
    each expert that has tokens in turn, its two products through the library."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the one host read
    tokens_sorted = order // topk_ids.shape[1]
    weights_sorted = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = tokens_sorted[start : start + count]
        gate, up = torch.nn.functional.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * weights_sorted[start : start + count, None])
        start += count
    return out.to(x.dtype)
