"""The split-K FP8 GEMV against the torch math of ``sonar.quantization.fp8``: dynamic and
static activation scales, split and unsplit, rows and inputs no tile divides, bias; and
``fp8_linear``'s one-row path at Llama-3.1-8B shapes and in a CUDA graph on the GPU."""

from __future__ import annotations

import pytest
import torch
from test_cuda_fp8 import assert_matches_reference, operands

from sonar_cuda.kernels.fp8_gemv_splitk import Fp8GemvLaunch, fp8_gemv_splitk
from sonar_cuda.kernels.fp8_linear import fp8_linear

CASES = [  # (N, K, bias, static, launch)
    (40, 1024, False, False, Fp8GemvLaunch(block_n=8, block_k=128, split_k=4)),
    (9, 300, True, False, Fp8GemvLaunch(block_n=4, block_k=64, split_k=3)),  # 5 chunks in 3 slices
    (33, 1024 + 96, True, True, Fp8GemvLaunch(block_n=8, block_k=256)),  # split chosen from the shape
    (16, 64, False, True, Fp8GemvLaunch(block_n=4, block_k=512, split_k=1)),
]


@pytest.mark.parametrize("n, k, bias, static, launch", CASES)
def test_split_k_gemv_matches_the_reference(n: int, k: int, bias: bool, static: bool, launch: Fp8GemvLaunch, device: torch.device) -> None:
    weight, scale, b = operands(n, k, device, bias)
    x = (torch.randn(1, k) * 2).to(device)
    input_scale = torch.tensor(0.01, device=device) if static else None
    assert_matches_reference(fp8_gemv_splitk(x, weight, scale, input_scale, b, launch), x, weight, scale, input_scale, b)


def test_one_row_with_leading_dims_keeps_its_shape(device: torch.device) -> None:
    weight, scale, b = operands(24, 512, device, True)
    x = torch.randn(1, 1, 512).to(device)
    out = fp8_gemv_splitk(x, weight, scale, None, b, Fp8GemvLaunch(block_n=8, block_k=128, split_k=2))
    assert out.shape == (1, 1, 24)
    assert_matches_reference(out, x, weight, scale, None, b)


@pytest.mark.cuda
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_one_row_at_llama_8b_shapes_in_a_cuda_graph(n: int, k: int, device: torch.device) -> None:
    weight, scale, _ = operands(n, k, device)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    for input_scale in (None, torch.tensor(0.02, device=device)):
        fp8_linear(x, weight, scale, input_scale)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_linear(x, weight, scale, input_scale)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_matches_reference(out, x, weight, scale, input_scale, None)
