"""Paged attention for prefill and chunked prefill, many sequences of any length in one launch.

Each sequence's new tokens sit after a cached context (from the prefix cache or an earlier
chunk); their keys and values are already written to the paged cache, so every key is read from
the cache. One program computes ``BLOCK_M`` query tokens of one head of one sequence, flash-style:
tiles of keys that every query row sees need no mask; the diagonal (causal) and, with a sliding
window, the window's leading edge are masked; tiles wholly before every row's window are
skipped, never read.

An FP8 cache (E4M3 or E5M2) is read as FP8 and converted to the query's dtype in registers (the
``KV_FP8`` specialisation); ``k_scale`` is folded into the softmax scale and ``v_scale`` into the
output.

A soft cap on the scores (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(scores / cap)``,
taken after the scale and before the causal and window masks) is the ``SOFTCAP`` specialisation;
without a cap the kernel is compiled without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.attention import dequantize_from_cache, is_fp8

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window a full-attention layer passes: longer than any context
TWO_LOG2E = tl.constexpr(2.0 * LOG2E)


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)``, in whatever units ``scores`` and ``cap`` share (the kernels
    pass both in log2 units). tanh is taken through exp2, which saturates: scores far past the cap
    give ``+-cap``, never NaN."""
    return cap - 2.0 * cap / (1.0 + tl.exp2(scores * (TWO_LOG2E / cap)))


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    kv_head_offset,
    tile_start,
    kv_start,
    kv_end,
    q_positions,
    window,
    dims,
    dim_mask,
    scale_log2,
    softcap_log2,
    stride_cache_block,
    stride_cache_slot,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # gather BLOCK_N keys and values through the block table: [BLOCK_N, BLOCK_D]; nothing before
    # kv_start (the earliest window start of the tile's rows) is read
    tokens = tile_start + tl.arange(0, BLOCK_N)
    if WINDOWED:
        token_mask = (tokens >= kv_start) & (tokens < kv_end)
    else:
        token_mask = tokens < kv_end
    pages = tl.load(block_table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    kv_offsets = pages * stride_cache_block + (tokens % PAGE_SIZE) * stride_cache_slot + kv_head_offset
    kv_mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    # online softmax in base 2: [BLOCK_M, BLOCK_N]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if SOFTCAP:
        scores = soft_cap(scores, softcap_log2)
    if MASKED:
        # causal, and inside the window: q - window < key <= q
        visible = tokens[None, :] <= q_positions[:, None]
        if WINDOWED:
            visible = visible & (tokens[None, :] > q_positions[:, None] - window)
        scores = tl.where(visible & token_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if MASKED and WINDOWED:
        # a row that has seen no key yet (its window starts later) keeps m = -inf: no -inf - -inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# per-step values (the block table's width, slices of the step's tensors at the first prefill
# row) are not specialised on: each new divisibility or alignment would compile a new kernel
@triton.jit(
    do_not_specialize=["stride_bt_seq"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,  # the softmax scale (times k_scale for an FP8 cache), in log2 units
    v_scale,  # an FP8 cache's value scale (unused otherwise)
    window,  # each query sees its last `window` positions, itself included
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,  # False: full attention, compiled without any window arithmetic
    SOFTCAP: tl.constexpr,  # False: no cap on the scores, compiled without it
    KV_FP8: tl.constexpr,  # the cache holds scaled float8_e4m3fn or float8_e5m2
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # q: [BLOCK_M, BLOCK_D]; row r is query token context_len + q_block * BLOCK_M + r
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_positions = context_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_tokens = (q_start + rows).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_offset = kv_head * stride_cache_head

    # key tiles: [window_lo, full_lo) the window's leading edge (masked), [full_lo, unmasked_end)
    # seen by every row (no mask), [unmasked_end, kv_end) the diagonal (masked); before
    # window_lo nothing is read
    first_q = context_len + q_block * BLOCK_M
    last_q = tl.minimum(first_q + BLOCK_M, seq_len) - 1
    unmasked_end = first_q // BLOCK_N * BLOCK_N
    kv_start = 0
    full_lo = 0
    if WINDOWED:
        kv_start = tl.maximum(first_q - window + 1, 0)
        window_lo = kv_start // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last_q - window + 1, 0), BLOCK_N) * BLOCK_N, unmasked_end)
        for tile_start in range(window_lo, full_lo, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table, kv_head_offset, tile_start, kv_start, seq_len,
                q_positions, window, dims, dim_mask, scale_log2, softcap_log2, stride_cache_block, stride_cache_slot,
                PAGE_SIZE, BLOCK_N, True, WINDOWED, SOFTCAP, KV_FP8, DOT_PRECISION,
            )
    for tile_start in range(full_lo, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table, kv_head_offset, tile_start, kv_start, seq_len,
            q_positions, window, dims, dim_mask, scale_log2, softcap_log2, stride_cache_block, stride_cache_slot,
            PAGE_SIZE, BLOCK_N, False, WINDOWED, SOFTCAP, KV_FP8, DOT_PRECISION,
        )
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_M)
    for tile_start in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table, kv_head_offset, tile_start, kv_start, kv_end,
            q_positions, window, dims, dim_mask, scale_log2, softcap_log2, stride_cache_block, stride_cache_slot,
            PAGE_SIZE, BLOCK_N, True, WINDOWED, SOFTCAP, KV_FP8, DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows past the sequence may have seen no key
    if KV_FP8:
        out = out * v_scale
    out_offsets = q_tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: cached context + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: row of each sequence's first new token
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context and themselves;
    with ``sliding_window=W`` each token sees only its last ``W`` positions (its own included),
    and key blocks before every token's window are never read.

    ``query_start_loc`` holds absolute rows of ``query``/``out``, so the prefill part of a mixed
    batch passes slices (``query_start_loc[num_decodes:]``) with the whole ``query``. The new
    tokens' keys and values must already be in the cache. ``k_scale`` / ``v_scale`` dequantize
    an FP8 cache (unused otherwise). ``logit_softcap=c`` caps the scaled scores at
    ``c * tanh(scores / c)`` before the masks and the softmax. Returns ``out``.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert query.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    fp32 = query.dtype == torch.float32
    kv_fp8 = is_fp8(k_cache.dtype)
    # tiles sized for the registers: fp32 and wide heads take smaller ones
    if block_m is None:
        block_m = 32 if fp32 else 64
    if block_n is None:
        block_n = 32 if fp32 or block_d > 128 else 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
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
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WINDOWED=sliding_window is not None,
        SOFTCAP=logit_softcap is not None,
        KV_FP8=kv_fp8,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def reference_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Plain float32 torch version of :func:`prefill_attention`; rows outside every sequence are 0."""
    num_heads = query.shape[1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for i in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        q_len = end - start
        positions = torch.arange(seq_len, device=query.device)
        pages = block_tables[i].long()[positions // page_size]
        k = dequantize_from_cache(k_cache[pages, positions % page_size], torch.float32, k_scale)
        v = dequantize_from_cache(v_cache[pages, positions % page_size], torch.float32, v_scale)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [seq_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_positions = torch.arange(seq_len - q_len, seq_len, device=query.device)
        hidden = positions[None, :] > q_positions[:, None]
        scores.masked_fill_(hidden[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
