"""Paged decode attention against its float32 reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import TOLERANCE, assert_close, dtypes_for, make_paged_batch

from sonar_cuda.kernels.decode_attention import choose_num_splits, decode_attention, reference_decode_attention

# (seq_lens, num_heads, num_kv_heads, head_dim, page_size, num_splits or None for automatic)
SMALL_CASES = [
    ([1, 17, 33], 4, 4, 64, 16, None),  # GQA 1, page boundaries +-1
    ([16, 31], 8, 2, 64, 8, 1),  # GQA 4
    ([40, 5], 8, 1, 128, 16, None),  # GQA 8, head_dim 128
    ([130, 9], 4, 1, 64, 16, 3),  # split-KV; the short sequence leaves two splits empty
]
LARGE_CASES = [
    ([1, 15, 16, 17, 255, 256, 257, 1000, 3071], 16, 8, 128, 16, None),  # Qwen3-0.6B heads
    ([4097, 33, 129], 32, 8, 128, 16, None),  # Llama-3.1-8B heads, auto split
    ([2000, 7, 513, 64], 32, 4, 64, 32, 5),
    ([777] * 40, 8, 8, 64, 16, 1),
    ([8191, 3], 64, 8, 128, 16, None),
    ([300, 45], 12, 12, 80, 24, 2),  # head_dim not a power of two, odd page size
]
# as above, with soft-capped scores
SOFTCAP_CASES = [
    ([1, 17, 33], 4, 2, 64, 16, 1),
    ([130, 9], 4, 1, 64, 16, 3),  # split-KV
]


def check(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_splits: int | None,
    dtype: torch.dtype,
    device: torch.device,
    logit_softcap: float | None = None,
    query_gain: float = 1.0,
) -> None:
    """Compare with the reference; ``query_gain`` scales the queries (and so the scores)."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + num_heads)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, device, gen)
    query = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * query_gain).to(dtype).to(device)
    scale = head_dim**-0.5
    out = decode_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, num_splits=num_splits,
        logit_softcap=logit_softcap,
    )
    expected = reference_decode_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, logit_softcap=logit_softcap
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, expected, dtype)
    if logit_softcap is not None:
        uncapped = reference_decode_attention(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
        assert (uncapped - expected).abs().max() > 2 * TOLERANCE[dtype], "a kernel ignoring the cap would pass"


@pytest.mark.parametrize("case", SMALL_CASES)
def test_decode_attention_small(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", LARGE_CASES)
def test_decode_attention_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)


@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_decode_attention_soft_cap(case: tuple, logit_softcap: float, device: torch.device) -> None:
    """Queries scaled by 8 give scores of up to about 25: a cap of 50 bends them, one of 5
    flattens them; the split-KV path combines capped partial softmaxes."""
    for dtype in dtypes_for(device):
        check(*case, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
def test_decode_attention_soft_cap_large(logit_softcap: float, dtype: torch.dtype, device: torch.device) -> None:
    check([4097, 33, 129], 32, 8, 128, 16, None, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)
    check([300, 45], 12, 12, 80, 24, 2, dtype, device, logit_softcap=logit_softcap, query_gain=8.0)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_soft_cap_over_an_fp8_cache(num_splits: int, kv_dtype: torch.dtype, device: torch.device) -> None:
    """The cap applies to the dequantized scores, also where a 16-bit query enters the product
    pre-scaled (scores in log2 units)."""
    k_scale, v_scale, logit_softcap = 0.5, 0.125, 5.0
    seq_lens, num_heads, num_kv_heads, head_dim, page_size = [130, 9], 4, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, torch.float32, device, gen)
    k_cache, v_cache = (batch.k_cache / k_scale).to(kv_dtype), (batch.v_cache / v_scale).to(kv_dtype)
    scale = head_dim**-0.5
    for dtype in dtypes_for(device):
        query = (torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * 4.0).to(dtype).to(device)
        out = decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, num_splits=num_splits,
            k_scale=k_scale, v_scale=v_scale, logit_softcap=logit_softcap,
        )
        expected = reference_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, k_scale, v_scale, logit_softcap
        )
        uncapped = reference_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, k_scale, v_scale
        )
        assert (uncapped - expected).abs().max() > 2 * TOLERANCE[dtype], "a kernel ignoring the cap would pass"
        assert_close(out, expected, dtype)


def test_num_splits_fill_the_gpu_but_keep_splits_long() -> None:
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 1
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 1
    assert choose_num_splits(num_seqs=8, num_kv_heads=8, max_seq_len=32_768, num_sms=132) == 4
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32_768, num_sms=132) == 33
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 16
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 2
