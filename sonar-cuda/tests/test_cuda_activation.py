"""SiLU-and-mul against its reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.activation import reference_silu_and_mul, silu_and_mul

SMALL_CASES = [(3, 64), (2, 1500)]  # (num_tokens, intermediate)
LARGE_CASES = [(1, 3072), (4099, 3072), (257, 14336), (33, 1000)]


def check(num_tokens: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    x = torch.randn(num_tokens, 2 * intermediate, generator=gen).mul(4).to(dtype).to(device)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    assert_close(out, reference_silu_and_mul(x), dtype)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_silu_and_mul_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_silu_and_mul_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)
