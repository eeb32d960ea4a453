"""The C GGUF kernel against float64 products of the dequantized blocks."""

from __future__ import annotations

import pytest
import torch

from sonar_cpu import gguf_kernel
from sonar_models.formats.gguf_blocks import (
    BLOCK_SIZES, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, GGUFBlocks, dequantize_blocks,
)

pytestmark = pytest.mark.skipif(gguf_kernel.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")


def random_blocks(ggml_type: int, rows: int, cols: int, generator: torch.Generator) -> GGUFBlocks:
    values, nbytes = BLOCK_SIZES[ggml_type]
    data = torch.randint(0, 256, (rows, cols // values, nbytes), dtype=torch.uint8, generator=generator)
    half = lambda t: t.half().view(torch.uint8).view(rows, cols // values, 2)  # noqa: E731
    data[..., 0:2] = half(torch.rand(rows, cols // values, generator=generator) * 0.02)
    if ggml_type in (Q4_1, Q5_1):
        data[..., 2:4] = half(torch.randn(rows, cols // values, generator=generator) * 0.01)
    return GGUFBlocks(ggml_type, rows, cols, data.reshape(rows, -1))


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the int8 product sees it: rounded to codes in blocks of 32, scale amax / 127
    (in float32, as the kernel computes them)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127) / top, 0)  # one rounding, as in C (127 / top rounds twice)
    codes = (blocks * inverse).round()
    return (codes.double() * (top / 127).double()).view_as(x)


BLOCKS_OF_32 = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL]
K_QUANTS = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS]


def check_against_the_dequantized_product(kernel: gguf_kernel.GGUFBlockKernel, blocks: GGUFBlocks, data: torch.Tensor,
                                          row_counts: list[int], generator: torch.Generator) -> None:
    """The exact product equal to the float one up to summation order; the int8 product equal
    to the float one of the activations as it rounds them."""
    rows, cols = blocks.shape
    weight = dequantize_blocks(blocks).double()
    for num_x in row_counts:
        x = torch.randn(num_x, cols, generator=generator)
        scale = (x.double().abs() @ weight.abs().T).max()
        out = kernel(x, data, rows, cols, exact=True)
        assert out.dtype == torch.float32 and out.shape == (num_x, rows)
        # float32 summation order only: a few ulps of the row's magnitude
        assert ((out.double() - x.double() @ weight.T).abs().max() / scale).item() < 1e-6
        # the int8 product: exact but for the activations' rounding to int8 blocks
        fast = kernel(x, data, rows, cols, exact=False)
        assert fast.shape == (num_x, rows)
        assert ((fast.double() - int8_blocks(x) @ weight.T).abs().max() / scale).item() < 1e-6
        assert ((fast.double() - x.double() @ weight.T).abs().max() / scale).item() < 1e-2


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
@pytest.mark.parametrize("prepared", [False, True])
def test_matches_the_dequantized_product(ggml_type: int, prepared: bool) -> None:
    lanes_only = ggml_type in gguf_kernel.LANES_ONLY
    if lanes_only and not prepared:
        pytest.skip("Q5_0, Q5_1 and IQ4_NL run in layout 8 only")
    generator = torch.Generator().manual_seed(ggml_type)
    for rows, cols in [(40, 96), (208, 160), (8, 32), (37, 64)]:
        blocks = random_blocks(ggml_type, rows, cols, generator)
        kernel = gguf_kernel.GGUFBlockKernel(ggml_type)
        data = kernel.prepare(blocks.data) if prepared else blocks.data
        assert kernel.layout == (gguf_kernel.LANES if prepared and (rows % 8 == 0 or lanes_only) else 1)
        check_against_the_dequantized_product(kernel, blocks, data, [*range(1, 12), 17, 20], generator)


def test_the_int8_product_of_zeros_and_of_blocks_with_one_large_value() -> None:
    generator = torch.Generator().manual_seed(1)
    blocks = random_blocks(Q4_1, 16, 64, generator)
    weight = dequantize_blocks(blocks).double()
    x = torch.zeros(2, 64)
    x[1, 5] = 1e4  # one block all zeros but one, the other block all zeros
    out = gguf_kernel.gguf_linear(x, Q4_1, blocks.data, 16, 64, exact=False)
    torch.testing.assert_close(out.double(), x.double() @ weight.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ggml_type", BLOCKS_OF_32)
def test_rows_come_back_in_the_files_layout(ggml_type: int) -> None:
    blocks = random_blocks(ggml_type, 40, 96, torch.Generator().manual_seed(2))
    kernel = gguf_kernel.GGUFBlockKernel(ggml_type)
    data = kernel.prepare(blocks.data)
    assert not torch.equal(data, blocks.data)  # laid out for the kernel
    for start, stop in [(0, 40), (5, 11), (8, 16), (39, 40)]:
        assert torch.equal(kernel.rows_in_order(data, start, stop), blocks.data[start:stop])


def test_refuses_a_width_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_kernel.gguf_linear(torch.zeros(1, 40), Q8_0, torch.zeros(1, 34, dtype=torch.uint8), 1, 40)


@pytest.mark.parametrize("ggml_type", [*BLOCKS_OF_32, *K_QUANTS])
def test_several_matrices_in_one_call_equal_one_call_each(ggml_type: int) -> None:
    """A mixture-of-experts layer's chosen experts, each over its own rows, in one call
    (``gguf_linear_experts``): as many ``exact=False`` calls, one per matrix, give the same."""
    generator = torch.Generator().manual_seed(ggml_type + 10)
    k_quant = ggml_type in K_QUANTS
    rows, cols = (24, 512) if k_quant else (48, 96)
    kernels, prepared = [], []
    for _ in range(4):
        kernel = gguf_kernel.GGUFBlockKernel(ggml_type)
        prepared.append(kernel.prepare((random_k_blocks if k_quant else random_blocks)(ggml_type, rows, cols, generator).data))
        kernels.append(kernel)
    for counts in ([1, 1, 1, 1], [2, 5, 1, 9], [3], [0 + 1, 7]):  # rows per matrix (matrices 0.. in use)
        starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
        x = torch.randn(int(starts[-1]), cols, generator=generator)
        pointers = torch.tensor([p.data_ptr() for p in prepared[: len(counts)]], dtype=torch.int64)
        out = kernels[0].experts(x, pointers, starts, rows, cols)
        for j in range(len(counts)):
            rows_j = slice(int(starts[j]), int(starts[j + 1]))
            torch.testing.assert_close(out[rows_j], kernels[j](x[rows_j], prepared[j], rows, cols, exact=False), atol=1e-5, rtol=1e-5)
    if ggml_type not in gguf_kernel.LANES_ONLY:  # those are always laid out for the kernel
        unprepared = gguf_kernel.GGUFBlockKernel(ggml_type)  # layout 1: not taken
        assert unprepared.experts(x, pointers, starts, rows, cols) is None


# -- the K-quants (super-blocks of 256) -------------------------------------------------------


def random_k_blocks(ggml_type: int, rows: int, cols: int, generator: torch.Generator) -> GGUFBlocks:
    """Random codes, scales and minimums (any bytes are valid ones) under small fp16 factors."""
    values, nbytes = BLOCK_SIZES[ggml_type]
    nsb = cols // values
    data = torch.randint(0, 256, (rows, nsb, nbytes), dtype=torch.uint8, generator=generator)
    half = lambda t: t.half().view(torch.uint8).view(rows, nsb, 2)  # noqa: E731
    factors = {Q2_K: (80, 82), Q3_K: (108,), Q6_K: (208,), IQ4_XS: (0,)}.get(ggml_type, (0, 2))  # where d (and dmin) sit
    for at in factors:
        data[..., at : at + 2] = half(torch.rand(rows, nsb, generator=generator) * 1e-3)
    return GGUFBlocks(ggml_type, rows, cols, data.reshape(rows, -1))


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_k_quants_match_the_dequantized_product(ggml_type: int) -> None:
    generator = torch.Generator().manual_seed(ggml_type)
    for rows, cols in [(16, 256), (40, 768), (13, 512)]:  # 13 rows: the last group filled with zero rows
        blocks = random_k_blocks(ggml_type, rows, cols, generator)
        kernel = gguf_kernel.GGUFBlockKernel(ggml_type)
        data = kernel.prepare(blocks.data)
        assert kernel.layout == gguf_kernel.LANES and data.shape[0] == -(-rows // 8) * 8
        check_against_the_dequantized_product(kernel, blocks, data, [1, 2, 3, 4, 5, 9], generator)


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_k_quant_rows_come_back_in_the_files_layout(ggml_type: int) -> None:
    blocks = random_k_blocks(ggml_type, 21, 512, torch.Generator().manual_seed(3))
    kernel = gguf_kernel.GGUFBlockKernel(ggml_type)
    data = kernel.prepare(blocks.data)
    for start, stop in [(0, 21), (5, 11), (8, 16), (20, 21)]:
        assert torch.equal(kernel.rows_in_order(data, start, stop), blocks.data[start:stop])


def test_a_k_quant_outside_layout_8_is_refused() -> None:
    blocks = random_k_blocks(Q4_K, 8, 256, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="layout 8"):
        gguf_kernel.gguf_linear(torch.zeros(1, 256), Q4_K, blocks.data, 8, 256, layout=1)
