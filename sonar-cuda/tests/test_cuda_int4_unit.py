"""The unit-float int4 kernels (one row: nibble-strided GEMV; 1 to 16 rows: the transposed
tensor-core product, on nibble planes less the zero point for 16-bit activations) against
the dequantized product: split and unsplit, groups of 32/64/128 inputs and whole rows, output
counts that no tile divides, zero points 0..16, bias; and through the ``int4_linear`` op
(with act-order, at Llama-3.1-8B shapes, in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, dtypes_for
from test_cuda_int4 import random_int4

from sonar_cuda.kernels.int4_gemm import reference_int4_linear
from sonar.quantization.int4_packing import dequantize_int4
from sonar_cuda import ops as cuda_ops
from sonar_cuda.kernels.int4_gemm import Int4Choice, run_choice
from sonar_cuda.kernels.int4_unit import Int4Launch, int4_dot_rows, int4_gemv_rows, int4_gemv_unit, int4_planes, x_planes

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
GEMV_CASES = [  # (N, K, group, bias, launch)
    (40, 512, 128, False, Int4Launch(block_n=4, runs_per_chunk=2, split_k=1)),
    (33, 1024, 128, True, Int4Launch(block_n=16, runs_per_chunk=1, split_k=4)),
    (24, 256, 64, True, Int4Launch(block_n=8, runs_per_chunk=2, split_k=2)),
    (8, 384, 32, False, Int4Launch(block_n=2, runs_per_chunk=2, split_k=3)),  # 12 runs in 3 slices
    (16, 256, -1, True, Int4Launch(block_n=32, runs_per_chunk=4)),  # split chosen from the shape
    (40, 1024, 128, True, Int4Launch(block_n=8, runs_per_chunk=1, split_k=3, prefetch=1)),  # 8 runs: slices of 3, 3, 2 chunks
    (24, 512, 64, False, Int4Launch(block_n=16, runs_per_chunk=2, split_k=1, prefetch=1)),
]
ROWS_CASES = [  # (N, K, group, bias, launch): words a step = 128 x warps
    (40, 512, 128, False, Int4Launch(block_n=8, num_warps=1, split_k=1)),  # a step longer than the row
    (33, 2048, 128, True, Int4Launch(block_n=4, num_warps=1, split_k=2)),  # two steps in two slices, a partial tile
    (24, 768, 64, True, Int4Launch(block_n=16, num_warps=1)),  # split chosen from the shape
    (16, 512, -1, True, Int4Launch(block_n=8, num_warps=1, split_k=1)),  # one scale per output row
    (8, 2560, 32, False, Int4Launch(block_n=2, num_warps=2, split_k=2)),  # 2 steps of 256 words (the last partial) in 2 slices
]
DOT_CASES = [  # (M, N, K, group, bias, launch)
    (2, 40, 512, 128, True, Int4Launch(block_n=16, split_k=2)),
    (16, 24, 256, -1, False, Int4Launch(block_n=16, split_k=1)),
    (5, 70, 384, 128, False, Int4Launch(block_n=32)),
    (1, 64, 256, 128, True, Int4Launch(block_n=64)),
]
PLANES_CASES = [  # (M, N, K, group, bias, launch)
    (1, 300, 1024, 128, False, Int4Launch(block_n=256, num_warps=8, split_k=2)),  # a partial tile, split
    (1, 64, 256, 128, True, Int4Launch(block_n=64)),
    (7, 130, 512, -1, True, Int4Launch(block_n=128, num_warps=4)),  # one scale per output row
    (16, 40, 384, 128, False, Int4Launch(block_n=64, split_k=3)),  # three runs in three slices
    (1, 300, 1024, 128, True, Int4Launch(block_n=128, split_k=3, runs_per_chunk=2)),  # 8 runs: slices of 3, 3, 2
    (4, 70, 640, 128, False, Int4Launch(block_n=64, split_k=2, runs_per_chunk=4)),  # 5 runs: slices of 3 and 2
    (16, 40, 256, -1, True, Int4Launch(block_n=32, split_k=1, runs_per_chunk=2)),  # two runs, one scale per row
    (1, 64, 128, 128, False, Int4Launch(block_n=64, runs_per_chunk=2)),  # one run: the loop's second adds nothing
]


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, operands: tuple, bias: torch.Tensor | None) -> None:
    expected = reference_int4_linear(x, *operands, bias)
    tol = TOLERANCE[x.dtype]
    assert out.shape == expected.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("n, k, group, with_bias, launch", GEMV_CASES)
def test_unit_gemv_matches_the_dequantized_product(n: int, k: int, group: int, with_bias: bool, launch: Int4Launch, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        operands = random_int4(n, k, group, dtype, device)
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(1, k, generator=gen).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
        assert_close_to_reference(int4_gemv_unit(x, *operands, bias, launch), x, operands, bias)


@pytest.mark.parametrize("n, k, group, with_bias, launch", ROWS_CASES)
def test_rows_gemv_matches_the_dequantized_product(n: int, k: int, group: int, with_bias: bool, launch: Int4Launch, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        operands = random_int4(n, k, group, dtype, device)
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(1, k, generator=gen).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
        assert_close_to_reference(int4_gemv_rows(x, *operands, bias, launch), x, operands, bias)


def test_x_planes_puts_each_plane_of_four_words_side_by_side() -> None:
    x = torch.arange(64, dtype=torch.bfloat16).reshape(1, 64)
    planes = x_planes(x).reshape(2, 8, 4)  # [block of 32 inputs][plane j][word i] = input 32 b + 8 i + j
    assert planes.dtype == torch.float32
    assert planes[0, 0].tolist() == [0, 8, 16, 24] and planes[0, 7].tolist() == [7, 15, 23, 31]
    assert planes[1, 3].tolist() == [35, 43, 51, 59]


@pytest.mark.parametrize("m, n, k, group, with_bias, launch", DOT_CASES)
def test_transposed_dot_matches_the_dequantized_product(m: int, n: int, k: int, group: int, with_bias: bool, launch: Int4Launch, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        operands = random_int4(n, k, group, dtype, device)
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
        assert_close_to_reference(int4_dot_rows(x, *operands, bias, launch), x, operands, bias)



@pytest.mark.parametrize("m, n, k, group, with_bias, launch", PLANES_CASES)
def test_nibble_planes_match_the_dequantized_product(m: int, n: int, k: int, group: int, with_bias: bool, launch: Int4Launch, device: torch.device) -> None:
    for dtype in (d for d in dtypes_for(device) if d != torch.float32):
        operands = random_int4(n, k, group, dtype, device)
        gen = torch.Generator().manual_seed(m + n)
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
        assert_close_to_reference(int4_planes(x, *operands, bias, launch), x, operands, bias)
        chosen = run_choice(Int4Choice("planes", launch), x, *operands, bias)
        torch.testing.assert_close(chosen, int4_planes(x, *operands, bias, launch), atol=0, rtol=0)

def test_the_op_takes_the_unit_kernels_with_act_order(device: torch.device) -> None:
    qweight, scales, qzeros, group = random_int4(48, 512, 128, torch.float32, device)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(5)).to(device)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(6)).to(device)
    weight = dequantize_int4(qweight, scales, qzeros, group)
    for rows in (1, 3):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(device)
        out = cuda_ops.int4_linear(x, qweight, scales, qzeros, group, order, bias)
        torch.testing.assert_close(out, x[:, order] @ weight.t() + bias, atol=1e-4, rtol=1e-4)


LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n, k", LLAMA_8B)
def test_the_chosen_kernels_at_llama_8b_shapes(n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
    operands = random_int4(n, k, 128, dtype, device)
    for m in (1, 4, 16):
        x = torch.randn(m, k, device=device).to(dtype)
        assert_close_to_reference(cuda_ops.int4_linear(x, *operands), x, operands, None)


@pytest.mark.cuda
def test_the_chosen_kernels_replay_in_a_cuda_graph(device: torch.device) -> None:
    operands = random_int4(4096, 14336, 128, torch.bfloat16, device)
    for rows in (1, 16):
        x = torch.randn(rows, 14336, device=device, dtype=torch.bfloat16)
        cuda_ops.int4_linear(x, *operands)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda_ops.int4_linear(x, *operands)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_close_to_reference(out, x, operands, None)

