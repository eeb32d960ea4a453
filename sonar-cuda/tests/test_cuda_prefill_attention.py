"""Paged prefill / chunked-prefill attention against its float32 reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import TOLERANCE, assert_close, dtypes_for, make_paged_batch

from sonar_cuda.kernels.prefill_attention import prefill_attention, reference_prefill_attention

# (per sequence (cached context, new tokens), num_heads, num_kv_heads, head_dim, page_size)
SMALL_CASES = [
    ([(0, 5), (16, 17), (3, 1), (0, 33)], 4, 4, 64, 16),  # fresh prompts, chunk after a full page
    ([(31, 2), (8, 40)], 8, 2, 64, 8),  # GQA 4, query blocks cross the diagonal
    ([(5, 19)], 8, 1, 128, 16),  # GQA 8, head_dim 128
]
LARGE_CASES = [
    ([(0, 1), (0, 17), (16, 16), (100, 257), (0, 1023), (2048, 129), (511, 513)], 16, 8, 128, 16),
    ([(0, 2000), (1500, 300), (7, 7)], 32, 8, 128, 16),
    ([(64, 64), (63, 65), (0, 777), (3000, 1)], 32, 4, 64, 32),
    ([(0, 100), (10, 90)], 8, 8, 64, 16),
    ([(129, 45), (0, 300)], 12, 12, 80, 24),  # head_dim not a power of two, odd page size
]
# as above, with soft-capped scores
SOFTCAP_CASES = [
    ([(0, 5), (16, 17), (0, 33)], 4, 2, 64, 16),
    ([(70, 40), (3, 1)], 4, 4, 32, 8),  # unmasked tiles before the diagonal
]


def check(
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    logit_softcap: float | None = None,
    query_gain: float = 1.0,
) -> None:
    """Compare with the reference; ``query_gain`` scales the queries (and so the scores)."""
    gen = torch.Generator().manual_seed(len(chunks) * 1000 + head_dim + num_heads)
    seq_lens = [context + new for context, new in chunks]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, device, gen)
    query_lens = [new for _, new in chunks]
    # two padding rows ahead of the prefills stand for a batch's decode tokens: left untouched
    offset = 2
    starts = torch.tensor([offset] + [offset + sum(query_lens[: i + 1]) for i in range(len(chunks))], dtype=torch.int32, device=device)
    num_tokens = offset + sum(query_lens)
    query = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) * query_gain).to(dtype).to(device)
    out = torch.full_like(query, 7.0)
    scale = head_dim**-0.5
    prefill_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, starts, max(query_lens), scale, out=out,
        logit_softcap=logit_softcap,
    )
    expected = reference_prefill_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, starts, scale, logit_softcap=logit_softcap
    )
    assert torch.all(out[:offset] == 7.0), "rows before query_start_loc[0] must not be written"
    assert_close(out[offset:], expected[offset:], dtype)
    if logit_softcap is not None:
        uncapped = reference_prefill_attention(
            query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, starts, scale
        )
        assert (uncapped - expected).abs().max() > 2 * TOLERANCE[dtype], "a kernel ignoring the cap would pass"


@pytest.mark.parametrize("case", SMALL_CASES)
def test_prefill_attention_small(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", LARGE_CASES)
def test_prefill_attention_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)


@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_prefill_attention_soft_cap(case: tuple, logit_softcap: float, device: torch.device) -> None:
    """Queries scaled by 8 give scores of up to about 25: a cap of 50 bends them, one of 5
    flattens them, in the masked (diagonal) and unmasked tiles alike."""
    for dtype in dtypes_for(device):
        check(*case, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
def test_prefill_attention_soft_cap_large(logit_softcap: float, dtype: torch.dtype, device: torch.device) -> None:
    check([(0, 2000), (1500, 300), (7, 7)], 32, 8, 128, 16, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)
    check([(129, 45), (0, 300)], 12, 12, 80, 24, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)
