"""The int4 GEMV and tiled GEMM (GPTQ/AWQ runtime layout) against the dequantized product,
the ``int4_linear`` op's routing (act-order gather, bias, shapes the kernels do not take), and
on the GPU: Llama-3.1-8B's shapes and capture in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, dtypes_for

from sonar import ops
from sonar.quantization.int4_packing import dequantize_int4, int4_linear, pack_int4
from sonar_cuda import ops as cuda_ops
from sonar_cuda.kernels.int4_gemm import int4_gemm, int4_gemv, reference_int4_linear

SMALL_CASES = [(1, 64, 128, 128, False), (1, 24, 384, 128, True), (1, 40, 256, 64, True), (5, 48, 256, -1, False), (17, 72, 128, 32, True)]  # (M, N, K, group, bias)
LARGE_CASES = [(1, 6144, 4096, 128), (1, 28672, 4096, 128), (1, 4096, 14336, 128), (16, 4096, 4096, 128), (16, 4096, 14336, -1), (300, 6144, 4096, 128)]


def random_int4(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed + n * 7 + k)
    groups = k // (k if group_size == -1 else group_size)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen), dim=1)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    qzeros = torch.randint(0, 17, (groups, n), generator=gen).to(dtype)
    return qweight.to(device), scales.to(device), qzeros.to(device), (k if group_size == -1 else group_size)


def check(m: int, n: int, k: int, group_size: int, with_bias: bool, dtype: torch.dtype, device: torch.device) -> None:
    qweight, scales, qzeros, group = random_int4(n, k, group_size, dtype, device)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    kernel = int4_gemv if m == 1 else int4_gemm
    out = kernel(x, qweight, scales, qzeros, group, bias)
    expected = reference_int4_linear(x, qweight, scales, qzeros, group, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    # the gemm rounds each dequantized weight to the dtype before its product; the gemv does not
    scale = expected.abs().max().item()
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_int4_kernels_match_the_dequantized_product(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(*case, dtype, device)
        if case[0] == 1:  # the same row through the tiled kernel
            check(2, *case[1:], dtype, device)


def test_int4_linear_op_gathers_act_order_inputs_and_keeps_leading_dims(device: torch.device) -> None:
    qweight, scales, qzeros, group = random_int4(32, 256, 64, torch.float32, device)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(device)
    weight = dequantize_int4(qweight, scales, qzeros, group)
    for x in (torch.randn(1, 1, 256), torch.randn(3, 256), torch.randn(2, 3, 256), torch.randn(0, 256)):
        x = x.to(device)
        out = cuda_ops.int4_linear(x, qweight, scales, qzeros, group, order)
        assert out.shape == (*x.shape[:-1], 32)
        torch.testing.assert_close(out, x[..., order] @ weight.t(), atol=1e-4, rtol=1e-4)


def test_shapes_the_kernels_do_not_take_run_dequantized(device: torch.device) -> None:
    # 8-input groups: no chunk of 32 fits a group; float16 activations over float32 scales
    qweight, scales, qzeros, group = random_int4(16, 64, 8, torch.float32, device)
    x = torch.randn(2, 64).to(device)
    expected = x @ dequantize_int4(qweight, scales, qzeros, group).t()
    torch.testing.assert_close(cuda_ops.int4_linear(x, qweight, scales, qzeros, group), expected, atol=1e-4, rtol=1e-4)
    half = cuda_ops.int4_linear(x.half(), qweight, scales, qzeros, group)
    assert half.dtype == torch.float16


def test_the_method_dispatches_to_the_registered_kernel(device: torch.device) -> None:
    """``sonar.quantization.int4_packing.int4_linear`` runs the platform's op once registered."""
    qweight, scales, qzeros, group = random_int4(24, 128, 128, torch.float32, device)
    x = torch.randn(1, 128).to(device)
    calls: list[int] = []

    def counting(*args):
        calls.append(1)
        return cuda_ops.int4_linear(*args)

    ops.register_ops(device.type, {"int4_linear": counting})
    try:
        out = int4_linear(x, qweight, scales, qzeros, group)
    finally:
        ops.unregister_ops(device.type)
    assert calls == [1]
    torch.testing.assert_close(out, int4_linear(x, qweight, scales, qzeros, group), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m, n, k, group", LARGE_CASES)
def test_int4_kernels_at_llama_8b_shapes(m: int, n: int, k: int, group: int, dtype: torch.dtype, device: torch.device) -> None:
    check(m, n, k, group, False, dtype, device)


@pytest.mark.cuda
def test_int4_linear_captures_in_a_cuda_graph(device: torch.device) -> None:
    qweight, scales, qzeros, group = random_int4(4096, 4096, 128, torch.bfloat16, device)
    order = torch.randperm(4096, device=device)
    for rows in (1, 16):
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        eager = cuda_ops.int4_linear(x, qweight, scales, qzeros, group, order)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda_ops.int4_linear(x, qweight, scales, qzeros, group, order)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, cuda_ops.int4_linear(x, qweight, scales, qzeros, group, order))
        assert not torch.equal(out, eager)
