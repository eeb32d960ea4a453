"""KV-cache write against its reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES

from sonar_cuda.kernels.kv_cache import reference_reshape_and_cache, reshape_and_cache

# (num_tokens, num_kv_heads, head_dim, num_blocks, page_size)
SMALL_CASES = [(5, 2, 64, 4, 16), (17, 1, 128, 3, 8), (3, 8, 64, 2, 16)]
LARGE_CASES = [(1, 8, 128, 64, 16), (4099, 8, 128, 600, 16), (1000, 4, 64, 100, 32), (333, 12, 80, 30, 24)]


def check(num_tokens: int, num_kv_heads: int, head_dim: int, num_blocks: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    # keys and values as strided views of a fused qkv projection: [num_tokens, heads, head_dim]
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens: never written
    slot_mapping = slots.to(device)
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    reference_reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_reshape_and_cache_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_reshape_and_cache_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)
