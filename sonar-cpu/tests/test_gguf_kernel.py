"""The C GGUF kernel against a float64 product of the dequantized blocks."""

from __future__ import annotations

import pytest
import torch

from sonar_cpu import gguf_kernel
from sonar_models.formats.gguf_blocks import BLOCK_SIZES, Q4_0, Q4_1, Q8_0, GGUFBlocks, dequantize_blocks

pytestmark = pytest.mark.skipif(gguf_kernel.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")


def random_blocks(ggml_type: int, rows: int, cols: int, generator: torch.Generator) -> GGUFBlocks:
    values, nbytes = BLOCK_SIZES[ggml_type]
    data = torch.randint(0, 256, (rows, cols // values, nbytes), dtype=torch.uint8, generator=generator)
    half = lambda t: t.half().view(torch.uint8).view(rows, cols // values, 2)  # noqa: E731
    data[..., 0:2] = half(torch.rand(rows, cols // values, generator=generator) * 0.02)
    if ggml_type == Q4_1:
        data[..., 2:4] = half(torch.randn(rows, cols // values, generator=generator) * 0.01)
    return GGUFBlocks(ggml_type, rows, cols, data.reshape(rows, -1))


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_matches_the_dequantized_product(ggml_type: int) -> None:
    generator = torch.Generator().manual_seed(ggml_type)
    for rows, cols in [(37, 96), (203, 160), (8, 32)]:
        blocks = random_blocks(ggml_type, rows, cols, generator)
        weight = dequantize_blocks(blocks).double()
        for num_x in range(1, 21):
            x = torch.randn(num_x, cols, generator=generator)
            expected = x.double() @ weight.T
            out = gguf_kernel.gguf_linear(x, ggml_type, blocks.data, rows, cols)
            assert out.dtype == torch.float32 and out.shape == (num_x, rows)
            # float32 summation order only: a few ulps of the row's magnitude
            scale = (x.double().abs() @ weight.abs().T).max()
            assert ((out.double() - expected).abs().max() / scale).item() < 1e-6


def test_refuses_a_width_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_kernel.gguf_linear(torch.zeros(1, 40), Q8_0, torch.zeros(1, 34, dtype=torch.uint8), 1, 40)
