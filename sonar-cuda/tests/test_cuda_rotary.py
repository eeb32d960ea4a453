"""Neox-style rotary embedding against its reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.rotary import build_cos_sin_cache, reference_rotary_embedding, rotary_embedding

# (num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim)
SMALL_CASES = [(3, 4, 4, 64, 64), (5, 8, 2, 128, 128), (2, 8, 1, 64, 32)]
LARGE_CASES = [(1, 16, 8, 128, 128), (4099, 32, 8, 128, 128), (777, 12, 4, 64, 64), (100, 32, 32, 80, 40)]


def check(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens + num_heads + head_dim)
    cache = build_cos_sin_cache(rotary_dim, max_position=8192, base=1_000_000.0, device=device)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).to(device)
    # query and key as strided views of a fused qkv projection
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    expected_q, expected_k = reference_rotary_embedding(positions, query, key, cache)
    rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before), "values must be untouched"


def test_position_zero_is_identity(device: torch.device) -> None:
    cache = build_cos_sin_cache(64, max_position=16, base=10_000.0, device=device)
    q = torch.randn(2, 4, 64, device=device)
    k = torch.randn(2, 2, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(2, dtype=torch.int64, device=device), q, k, cache)
    assert torch.allclose(q, q0) and torch.allclose(k, k0)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_rotary_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_rotary_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)
