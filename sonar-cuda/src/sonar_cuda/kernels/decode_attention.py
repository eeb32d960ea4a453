"""Paged attention for decode: one new token per sequence.

One program handles every query head of one KV head (GQA-aware: each K/V tile is read once for
the whole group) over one split of the sequence's context. With several splits, each writes a
partial output and its log-sum-exp, and a second kernel combines them; long contexts at small
batch sizes so still fill the GPU. With a sliding window, the context is only the window's last
tokens: the splits divide that, and nothing before it is read.

An FP8 cache (E4M3 or E5M2) is read as FP8 and converted in registers (the ``KV_FP8``
specialisation); ``k_scale`` is folded into the softmax scale and ``v_scale`` into the output.
Under a 16-bit query the products run in float16 (``FP8_AS_F16``): E4M3 and E5M2 values are
exact in float16, the probabilities (in [0, 1]) keep more bits there than in bfloat16, and the
query enters the product already multiplied by the softmax scale (its magnitude shrinks;
clamped to the float16 range). On the H200 this takes the same time as converting to bfloat16.

A soft cap on the scores (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(scores / cap)``,
taken after the scale and before the masks) is the ``SOFTCAP`` specialisation; without a cap the
kernel is compiled without it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sonar.attention import dequantize_from_cache, is_fp8
from sonar_cuda.kernels.prefill_attention import soft_cap

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64
RESIDENT_PER_SM = 2  # decode programs one H200 multiprocessor holds at once (shared memory, 3 stages)
NO_WINDOW = 1 << 30  # the window a full-attention layer passes: longer than any context
F16_MAX = tl.constexpr(65504.0)


# the block table's width changes from step to step: not specialised on (see prefill_attention)
@triton.jit(do_not_specialize=["stride_bt_seq"], do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim] when not SPLIT
    part_out_ptr,  # [num_seqs, num_heads, num_splits, BLOCK_D] float32 when SPLIT
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32 when SPLIT (log2 units)
    scale_log2,  # the softmax scale (times k_scale for an FP8 cache), in log2 units
    v_scale,  # an FP8 cache's value scale (unused otherwise)
    window,  # the query sees its last `window` positions, itself included
    softcap_log2,  # the cap on the scores, in log2 units (unused unless SOFTCAP)
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    stride_out_token,
    stride_out_head,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr,  # False: no cap on the scores, compiled without it
    KV_FP8: tl.constexpr,  # the cache holds scaled float8_e4m3fn or float8_e5m2
    FP8_AS_F16: tl.constexpr,  # an FP8 cache under a 16-bit query: products in float16, q pre-scaled
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # this split's token range within the window, in whole BLOCK_N tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start = tl.maximum(seq_len - window, 0)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - window_start, num_splits), BLOCK_N) * BLOCK_N
    start = window_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # q: [GROUP_PAD, BLOCK_D], the group's heads as rows
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offsets = seq.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP8_AS_F16:
        q = tl.clamp(q.to(tl.float32) * scale_log2, -F16_MAX, F16_MAX).to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(start, end, BLOCK_N):
        # gather BLOCK_N tokens through the block table: [BLOCK_N, BLOCK_D]
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = tl.load(block_table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        kv_offsets = pages * stride_cache_block + (tokens % PAGE_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        # online softmax in base 2: [GROUP_PAD, BLOCK_N]
        if FP8_AS_F16:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0.0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    if SPLIT:
        part = (seq * GROUP * tl.num_programs(1) + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out, mask=row_mask[:, None])
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)
    else:
        out_offsets = seq.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    num_splits,  # a runtime value: one compiled kernel per power-of-two pad, not per count
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    # weights of each split: [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + row + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - lse_max)
    weights = weights / tl.sum(weights, 0)
    # [SPLITS_PAD, BLOCK_D]
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * BLOCK_D + dims[None, :], mask=split_mask[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    out_offsets = seq.to(tl.int64) * stride_out_token + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV factor: as many splits as fit the GPU's resident programs in one wave (a partly
    filled second wave costs more than it gains), never a split shorter than
    ``MIN_TOKENS_PER_SPLIT`` tokens.

    Measured on an H200 (bf16, 8 KV heads, head_dim 128): 1 x 1k tokens 27 us unsplit, 6 us in
    16 splits; 1 x 32k tokens 121 us in 8 splits, 45 us in 32; 8 x 32k tokens 272 us in 5 splits,
    342 us in 9; 64 x 1k tokens 67 us unsplit, 70 us in 2.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = (RESIDENT_PER_SM * num_sms) // programs
    return max(1, min(wanted, math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


BLOCK_N = 64  # cached tokens per tile
# warps per program: 4 for a 16-bit cache (H200, 32 query / 8 KV heads of 128, 64-token tiles:
# 136-137 us at 125 sequences x 1,100 cached tokens, 277-278 at 256, with 2 or 4 warps)
NUM_WARPS = 4
NUM_STAGES = 3
# an FP8 cache's tile, warps and stages, apart from the 16-bit cache's: 32-token tiles with 1 warp
# and 5 stages. The kernel alone at 256 sequences x 1,100 cached tokens: 171 us against 190 with
# 64-token tiles and 2 warps (256-275 with 4); workload c with FP8 weights and this cache, one
# engine each in one run: 19,984 output tok/s against 19,359 (+3.2%)
# (``python sonar-cuda/benchmarks/kv_fp8.py --quantization fp8 --kv-dtypes fp8 --fp8-launch 64:2:3``)
FP8_BLOCK_N = 32
FP8_NUM_WARPS = 1
FP8_NUM_STAGES = 5


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attend each sequence's single new query token over its paged context: all of it, or
    with ``sliding_window=W`` its last ``W`` positions (the token's own included; blocks before
    them are never read, so the block table may name stale blocks there).

    The new token's key and value must already be in the cache. ``num_splits`` (the split-KV
    factor) defaults to a choice from the batch size and ``max_seq_len``; pass it explicitly to
    keep the launch shape fixed (CUDA graphs). ``k_scale`` / ``v_scale`` dequantize an FP8
    cache (unused otherwise). ``logit_softcap=c`` caps the scaled scores at
    ``c * tanh(scores / c)`` before the softmax. Returns ``out``.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert query.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if sliding_window is not None:
            max_seq_len = min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    kv_fp8 = is_fp8(k_cache.dtype)
    if block_n is None:
        block_n = FP8_BLOCK_N if kv_fp8 else BLOCK_N
    if num_warps is None:
        num_warps = FP8_NUM_WARPS if kv_fp8 else NUM_WARPS
    if num_stages is None:
        num_stages = FP8_NUM_STAGES if kv_fp8 else NUM_STAGES
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        NO_WINDOW if sliding_window is None else sliding_window,
        0.0 if logit_softcap is None else logit_softcap * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        SOFTCAP=logit_softcap is not None,
        KV_FP8=kv_fp8,
        FP8_AS_F16=kv_fp8 and query.dtype in (torch.bfloat16, torch.float16),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            num_warps=4 if block_d >= 128 else 2,
        )
    return out


def reference_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Plain float32 torch version of :func:`decode_attention` (returns float32)."""
    num_seqs, num_heads, _ = query.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        positions = torch.arange(seq_len, device=query.device)
        pages = block_tables[i].long()[positions // page_size]
        k = dequantize_from_cache(k_cache[pages, positions % page_size], torch.float32, k_scale)
        v = dequantize_from_cache(v_cache[pages, positions % page_size], torch.float32, v_scale)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq_len, H, D]
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


def warm_up_decode_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
    """Compile the split-KV reduction for every power-of-two pad up to ``MAX_SPLITS`` (eager
    steps choose their split count per step; without this the first steps of a new shape pay
    Triton's compile time)."""
    head_dim, page_size = k_cache.shape[-1], k_cache.shape[1]
    device = k_cache.device
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    splits = 2
    while splits <= MAX_SPLITS:
        num_pages = -(-splits * MIN_TOKENS_PER_SPLIT // page_size)
        if num_pages > k_cache.shape[0]:
            break
        block_tables = torch.arange(num_pages, dtype=torch.int32, device=device).unsqueeze(0)
        seq_lens = torch.tensor([num_pages * page_size], dtype=torch.int32, device=device)
        decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 1.0, max_seq_len=num_pages * page_size, num_splits=splits)
        splits *= 2
