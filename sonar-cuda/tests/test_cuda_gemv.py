"""The one-row matrix-vector product and the row-wise argmax against their references, and
the CUDA ops routing products to them only where they apply."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, TOLERANCE, dtypes_for

from sonar_cuda import ops as cuda_ops
from sonar_cuda.kernels.argmax import BLOCK, argmax
from sonar_cuda.kernels.gemv import MAX_SHORT_ROWS, gemv, gemv_pays, gemv_supported, reference_gemv

SMALL_CASES = [(8, 64, False), (5, 300, True), (3, 2048 + 96, False), (2, 4096, True)]  # (rows, K, bias)
LARGE_CASES = [(6144, 4096, False), (4096, 4096, True), (4096, 14336, False), (1000, 1000, True), (128256, 4096, False), (16384, 1024, True)]


def check_gemv(n: int, k: int, with_bias: bool, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    x = torch.randn(1, k, generator=gen).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
    out = gemv(x, weight, bias)
    assert out.shape == (1, n) and out.dtype == dtype
    # one rounding of the float32 sum to the output dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference_gemv(x, weight, bias), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_gemv_small(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check_gemv(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_gemv_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check_gemv(*case, dtype, device)


def test_gemv_takes_views_of_one_row(device: torch.device) -> None:
    """A ``[1, 1, K]`` input and a weight that is a row slice of a bigger one (a merged
    projection's part) give the product; non-contiguous rows and several rows are refused."""
    weight = torch.randn(48, 256).to(device)
    part = weight[16:40]
    x = torch.randn(1, 1, 256).to(device)
    out = gemv(x, part)
    assert out.shape == (1, 1, 24)
    torch.testing.assert_close(out.float(), reference_gemv(x, part), atol=2e-4, rtol=2e-4)
    assert not gemv_supported(torch.randn(2, 256).to(device), weight, None)
    assert not gemv_supported(torch.randn(1, 512).to(device)[:, ::2], weight, None)
    assert not gemv_supported(x, weight.t(), None)
    assert not gemv_supported(x.half(), weight, None)
    # many short rows: computed right, but the op leaves them to the library
    many_short = torch.randn(MAX_SHORT_ROWS + 1, 64).to(device)
    assert not gemv_pays(many_short) and gemv_pays(many_short[:MAX_SHORT_ROWS]) and gemv_pays(torch.randn(2 * MAX_SHORT_ROWS, 2048))


def test_linear_op_routes_one_row_to_the_kernel_and_the_rest_to_torch(device: torch.device) -> None:
    weight = torch.randn(40, 128).to(device)
    bias = torch.randn(40).to(device)
    for x in (torch.randn(1, 128), torch.randn(7, 128), torch.randn(2, 3, 128), torch.randn(0, 128)):
        x = x.to(device)
        out = cuda_ops.linear(x, weight, bias)
        assert out.shape == (*x.shape[:-1], 40)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), atol=2e-4, rtol=2e-4)
    # degenerate shapes: no output rows, or rows of length zero (the bias alone)
    x = torch.randn(1, 128).to(device)
    assert cuda_ops.linear(x, weight[:0], bias[:0]).shape == (1, 0)
    torch.testing.assert_close(cuda_ops.linear(x[:, :0], weight[:, :0], bias), bias[None, :])


ARGMAX_CASES = [(1, 10), (3, BLOCK), (2, BLOCK + 1), (4, 3 * BLOCK - 7)]


@pytest.mark.parametrize("rows, cols", ARGMAX_CASES)
def test_argmax_matches_torch(rows: int, cols: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen)
    # ties across blocks and within a block: the first index wins, as in torch
    x[0, cols // 2] = x[0, -1] = 100.0
    if rows > 1:
        x[1, :] = 5.0
    if rows > 2:
        x[2, :] = float("-inf")
    if rows > 3:
        x[3, 17] = float("nan")
        x[3, 5] = float("inf")
    x = x.to(device)
    for tensor in (x, x.to(torch.bfloat16)):
        assert torch.equal(argmax(tensor).cpu(), tensor.cpu().argmax(dim=-1))
    assert torch.equal(cuda_ops.argmax(x[:, ::2]).cpu(), x[:, ::2].cpu().argmax(dim=-1))  # strided: torch's


@pytest.mark.cuda
def test_argmax_over_a_vocabulary_batch(device: torch.device) -> None:
    x = torch.randn(256, 151936, device=device)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("case", [(40, 256, 3, 24, True), (70, 300, 2, 48, False), (16, 1024, 8, 16, False)])
def test_gemv_with_the_shrink_of_a_lora_slot(case: tuple, device: torch.device) -> None:
    """The product and an adapter slot's shrink in one launch: each equals its torch version,
    for every slot and for none (-1, or past the slots: zeros); the product is bit for bit
    :func:`gemv`'s."""
    from sonar.lora.ops import torch_lora_shrink
    from sonar_cuda.kernels.gemv import gemv_with_shrink

    n, k, num_slots, num_a_rows, with_bias = case
    for dtype in dtypes_for(device):
        gen = torch.Generator().manual_seed(n + k)
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
        a = (torch.randn(num_slots, num_a_rows, k, generator=gen) / k**0.5).to(dtype).to(device)
        x = torch.randn(1, k, generator=gen).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device) if with_bias else None
        for slot in (*range(num_slots), -1, num_slots):
            slots = torch.tensor([slot], dtype=torch.int32, device=device)
            out, shrunk = gemv_with_shrink(x, weight, bias, a, slots)
            assert torch.equal(out, gemv(x, weight, bias))
            assert shrunk.dtype == torch.float32 and shrunk.shape == (1, num_a_rows)
            expected = torch_lora_shrink(x.float().cpu(), a.float().cpu(), torch.tensor([slot if slot < num_slots else -1]))
            torch.testing.assert_close(shrunk.cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # the op takes one row of a weight the matrix-vector product serves, else declines
    assert cuda_ops.lora_linear_shrink(torch.randn(2, 256).to(device), torch.randn(40, 256).to(device), None,
                                       torch.randn(2, 8, 256).to(device), torch.zeros(2, dtype=torch.int32, device=device)) is None  # fmt: skip
