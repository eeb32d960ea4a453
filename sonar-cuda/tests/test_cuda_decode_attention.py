"""Paged decode attention against its float32 reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import assert_close, dtypes_for, make_paged_batch

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


def check(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_splits: int | None, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + num_heads)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, device, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    out = decode_attention(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale, num_splits=num_splits)
    expected = reference_decode_attention(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_decode_attention_small(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", LARGE_CASES)
def test_decode_attention_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)


def test_num_splits_fill_the_gpu_but_keep_splits_long() -> None:
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 1
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 1
    assert choose_num_splits(num_seqs=8, num_kv_heads=8, max_seq_len=32_768, num_sms=132) == 4
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32_768, num_sms=132) == 33
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 16
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 2
