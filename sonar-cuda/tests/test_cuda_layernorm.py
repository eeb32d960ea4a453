"""RMSNorm and fused residual-add + RMSNorm against their reference; the FP8 rows they emit
for an FP8 product equal to quantizing their output apart."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.fp8_quant import quantize_rows
from sonar_cuda.kernels.layernorm import fused_add_rms_norm, fused_add_rms_norm_fp8, reference_rms_norm, rms_norm, rms_norm_fp8

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


def check_fp8_rows(num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """The norm's FP8 rows are its own output quantized per token, bit for bit; the output is
    the plain kernel's (to the last bit under the interpreter; on the GPU the two
    specializations may sum the squares in another order)."""
    gen = torch.Generator().manual_seed(7 * num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).mul(3).to(dtype).to(device)
    x[0, : hidden // 2] = 0.0  # a row half zeros, and (below) one all zeros: the scale's floor
    if num_tokens > 1:
        x[1] = 0.0
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    eps = 1e-6

    out, q, scale = rms_norm_fp8(x, weight, eps)
    assert_close(out, rms_norm(x, weight, eps), dtype)
    expected_q, expected_scale = quantize_rows(out)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))

    plain_x, plain_residual = x.clone(), residual.clone()
    fused_add_rms_norm(plain_x, plain_residual, weight, eps)
    q, scale = fused_add_rms_norm_fp8(x, residual, weight, eps)
    assert torch.equal(residual, plain_residual)
    assert_close(x, plain_x, dtype)
    expected_q, expected_scale = quantize_rows(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("case", [(3, 64), (2, 100), (1, 128)])
def test_fp8_rows_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check_fp8_rows(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", [(1, 4096), (256, 4096), (33, 5120), (5, 896)])
def test_fp8_rows_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check_fp8_rows(*case, dtype, device)
