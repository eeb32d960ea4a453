"""RMSNorm and fused residual-add + RMSNorm against their reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.layernorm import fused_add_rms_norm, reference_rms_norm, rms_norm

SMALL_CASES = [(3, 64), (2, 100), (1, 128)]  # (num_tokens, hidden)
LARGE_CASES = [(1, 1024), (257, 4096), (4099, 896), (33, 5120), (7, 8192)]


def check(num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).mul(3).to(dtype).to(device)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    eps = 1e-6

    # plain
    expected, _ = reference_rms_norm(x, weight, eps)
    assert_close(rms_norm(x, weight, eps), expected, dtype)

    # fused with the residual add, in place
    expected, expected_residual = reference_rms_norm(x, weight, eps, residual=residual)
    fused_add_rms_norm(x, residual, weight, eps)
    if device.type == "cuda":
        assert torch.equal(residual, expected_residual)
    else:  # the interpreter rounds bf16 by truncation
        assert_close(residual, expected_residual, dtype)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_rms_norm_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_rms_norm_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)
