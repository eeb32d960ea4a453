"""The FP8 kernels against the torch math of ``sonar.quantization.fp8``: activation
quantization, the fused batch-1 GEMV, the tiled GEMM and the per-shape dispatch (with
``torch._scaled_mm`` on the GPU), in CUDA graphs too."""

from __future__ import annotations

import pytest
import torch

from sonar.quantization.fp8 import FP8_DTYPE, per_token_scale, quantize_per_row, reference_fp8_linear, to_fp8
from sonar_cuda.kernels.fp8_gemm import fp8_gemm
from sonar_cuda.kernels.fp8_gemv import fp8_gemv, fp8_gemv_prepared, fp8_gemv_supported
from sonar_cuda.kernels.fp8_linear import fp8_linear
from sonar_cuda.kernels.fp8_quant import quantize_rows

# one rounding of a float32 sum to the output dtype; FP8 products are exact in float32
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def operands(n: int, k: int, device: torch.device, bias: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight, scale = quantize_per_row(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(device) if bias else None
    return weight.to(device), scale.to(device), b


def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    expected = reference_fp8_linear(x.float(), weight, scale, input_scale, None if bias is None else bias.float())
    tol = TOLERANCE[out.dtype]
    assert out.shape == expected.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("m, k", [(1, 16), (3, 300), (2, 4096 + 64)])
def test_quantize_rows_equals_the_torch_rounding(m: int, k: int, device: torch.device) -> None:
    x = torch.randn(m, k) * 3
    x[0, 0] = 0.0
    x[-1] *= torch.logspace(-6, 0, k)  # E4M3 subnormals too
    x = x.to(device)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (m, 1)
    torch.testing.assert_close(scale, per_token_scale(x), atol=0, rtol=1e-6)
    assert torch.equal(q.float(), to_fp8(x, per_token_scale(x)).float())
    static = torch.tensor(0.004, device=device)
    q, scale = quantize_rows(x, static)
    assert torch.equal(scale, static.expand(m, 1)) and torch.equal(q.float(), to_fp8(x, static).float())  # saturates at 448


@pytest.mark.parametrize("n, k, bias, static", [(40, 64, False, False), (9, 300, True, False), (33, 1024 + 96, False, True)])
def test_fp8_gemv_matches_the_reference(n: int, k: int, bias: bool, static: bool, device: torch.device) -> None:
    weight, scale, b = operands(n, k, device, bias)
    x = torch.randn(1, k).to(device)
    input_scale = torch.tensor(0.01, device=device) if static else None
    assert fp8_gemv_supported(x, weight) and not fp8_gemv_supported(torch.randn(2, k).to(device), weight)
    assert_matches_reference(fp8_gemv(x, weight, scale, input_scale, b), x, weight, scale, input_scale, b)


@pytest.mark.parametrize("n, k, tile", [(41, 96, (4, 4, 2)), (33, 1024 + 96, (2, 4, 3)), (40, 64, (8, 4, 0)), (17, 5000, (0, 0, -1))])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_gemv_tiles_and_waves_match_the_reference(n: int, k: int, tile: tuple[int, int, int], static: bool, device: torch.device) -> None:
    # a program per tile of rows, or one wave of programs taking several tiles each (rows no tile divides)
    weight, scale, b = operands(n, k, device, True)
    x = torch.randn(1, k).to(device)
    input_scale = torch.tensor(0.01, device=device) if static else None
    assert_matches_reference(fp8_gemv(x, weight, scale, input_scale, b, *tile), x, weight, scale, input_scale, b)


@pytest.mark.parametrize("n, k, rows, bias", [(40, 64, 1, False), (9, 300, 2, True), (33, 5000, 1, True), (17, 8192 + 32, 4, False)])
def test_the_prepared_gemv_matches_the_reference(n: int, k: int, rows: int, bias: bool, device: torch.device) -> None:
    # one row the norm already quantized: rows past 4,096 inputs in masked chunks, tiles no row count divides
    weight, scale, b = operands(n, k, device, bias)
    x = torch.randn(1, k).to(device)
    q, x_scale = quantize_rows(x)
    out = fp8_gemv_prepared(q, x_scale, weight, scale, b, torch.float32, rows)
    assert_matches_reference(out, x, weight, scale, None, b)
    through_op = fp8_linear(x, weight, scale, x_scale, b, quantized=q)
    torch.testing.assert_close(through_op, fp8_gemv_prepared(q, x_scale, weight, scale, b, torch.float32), atol=0, rtol=0)


@pytest.mark.parametrize("m, n, k, bias", [(5, 40, 96, False), (17, 24, 160, True)])
def test_fp8_gemm_matches_the_reference(m: int, n: int, k: int, bias: bool, device: torch.device) -> None:
    weight, scale, b = operands(n, k, device, bias)
    x = torch.randn(m, k).to(device)
    q, x_scale = quantize_rows(x)
    out = fp8_gemm(q, weight, x_scale, scale, b, torch.float32, config=(16, 16, 32, 4, 2))
    assert_matches_reference(out, x, weight, scale, None, b)


def test_fp8_linear_takes_any_leading_shape(device: torch.device) -> None:
    weight, scale, _ = operands(32, 64, device)
    for x in (torch.randn(1, 64), torch.randn(1, 1, 64), torch.randn(3, 64), torch.randn(0, 64)):
        x = x.to(device)
        assert_matches_reference(fp8_linear(x, weight, scale, None), x, weight, scale, None, None)


def test_fp8_linear_takes_given_per_token_scales(device: torch.device) -> None:
    # a row-parallel rank's: each token's scale over its whole row, at least its own slice's
    weight, scale, _ = operands(24, 160, device)
    for m in (1, 5):
        x = torch.randn(m, 160).to(device)
        given = per_token_scale(x) * torch.linspace(1.0, 3.0, m, device=device)[:, None]
        assert_matches_reference(fp8_linear(x, weight, scale, given), x, weight, scale, given, None)


LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 128, 1024])
@pytest.mark.parametrize("n, k", LLAMA_8B_SHAPES)
def test_fp8_linear_on_llama_8b_shapes(m: int, n: int, k: int, device: torch.device) -> None:
    weight, scale, _ = operands(n, k, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    for input_scale in (None, torch.tensor(0.02, device=device)):
        out = fp8_linear(x, weight, scale, input_scale)
        expected = reference_fp8_linear(x, weight, scale, input_scale, None)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_linear_replays_in_a_cuda_graph(m: int, device: torch.device) -> None:
    weight, scale, _ = operands(4096, 4096, device)
    x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
    fp8_linear(x, weight, scale, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, weight, scale, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), reference_fp8_linear(x, weight, scale, None, None).float(), atol=2e-2, rtol=2e-2)
