"""The batch-1 matrix-vector product against a float32 reference, and the op that picks it."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.gemv import CONFIGS, gemv, reference_gemv

SMALL_CASES = [(24, 40, False), (17, 1030, True)]  # (N, K, bias): ragged rows and columns
LARGE_CASES = [(4096, 4096, False), (6144, 4096, True), (4096, 14336, False), (1000, 333, True)]


def check(n: int, k: int, with_bias: bool, dtype: torch.dtype, device: torch.device, configs=CONFIGS) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=gen).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    expected = reference_gemv(x, weight, bias)
    for block_n, block_k in configs:
        out = gemv(x, weight, bias, block_n, block_k)
        assert out.shape == (1, n) and out.dtype == dtype
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_gemv_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device, configs=[(4, 16), (8, 32)])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_gemv_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)


@pytest.mark.cuda
def test_linear_op_matches_the_library_at_batch_1() -> None:
    from sonar_cuda.ops import linear

    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(4096, 4096, generator=gen) / 64).to(torch.bfloat16).cuda()
    for rows in (1, 2, 7):
        x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).cuda()
        assert_close(linear(x, weight), reference_gemv(x, weight), torch.bfloat16)
