"""``sonar.ops`` operation ``fp8_linear`` on CUDA: the product kernel chosen per shape.

One row of activations (decode at batch 1): the fused FP8 GEMV (activation quantization inside,
one launch, ``sonar_cuda.kernels.fp8_gemv``) at every shape it takes, with the tile in
``GEMV_TILES`` where the H200 sweep (``fp8_decode.py --part gemv``) chose one, its default
otherwise. Otherwise the activations are quantized by one Triton launch, then
``torch._scaled_mm`` with row-wise scales (CUTLASS on Hopper; bf16 output, K and N multiples of
16) from ``SCALED_MM_MIN_ROWS`` rows, the Triton tiled GEMM below that and where
``_scaled_mm`` cannot run the shape (H200, Llama-3.1-8B, M = 16: Triton 12.3-43.5 us against
_scaled_mm 16.0-48.3; M = 128: _scaled_mm 16.5-41.5 against Triton 20.6-40.8). Nothing here
synchronises with the host, so decode graphs capture it.
"""

from __future__ import annotations

import functools

import torch

from sonar.quantization.fp8 import to_fp8
from sonar_cuda.kernels.fp8_gemm import fp8_gemm
from sonar_cuda.kernels.fp8_gemv import fp8_gemv, fp8_gemv_prepared, fp8_gemv_supported
from sonar_cuda.kernels.fp8_quant import quantize_rows

SCALED_MM_MIN_ROWS = 17
# (N, K) -> (rows per program, warps, programs per multiprocessor or 0): Llama-3.1-8B's projections,
# the fastest of an H200 sweep (one row, us: qkv 8.3, o 6.8, gate_up 29.5, down 20.7; the first
# GEMV 11.8 / 9.7 / 44.3 / 40.4, quantize + Triton GEMM 13.0 / 11.0 / 33.9 / 29.6, bf16 12.8-12.9 /
# 9.3 / 53.4-54.3 / 30.7)
GEMV_TILES: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (4, 4, 8),
    (4096, 4096): (8, 8, 0),
    (28672, 4096): (4, 4, 0),
    (4096, 14336): (2, 8, 2),
}


def scaled_mm_runs(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales takes this product on this device."""
    return dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and _capability() >= (9, 0)


@functools.cache
def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    quantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sonar.quantization.fp8.fp8_linear`` on CUDA tensors: same arguments, same math. One
    row already quantized (``quantized``, the norm's) takes the prepared GEMV, which only
    streams the weights; one row with a given scale takes the GEMV that quantizes the row with
    that scale as it reads it (no amax pass)."""
    n, k = weight.shape
    if quantized is not None and fp8_gemv_supported(quantized, weight) and input_scale.numel() == 1:
        return fp8_gemv_prepared(quantized, input_scale, weight, weight_scale, bias, x.dtype).view(*x.shape[:-1], n)
    if fp8_gemv_supported(x, weight) and (input_scale is None or input_scale.numel() == 1):
        return fp8_gemv(x, weight, weight_scale, input_scale, bias, *GEMV_TILES.get((n, k), (0, 0, -1)))
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if quantized is not None:  # the rows the norm's kernel made, with their per-token scales
        q, x_scale = quantized.reshape(m, k), input_scale.float().reshape(m, 1)
    elif input_scale is not None and input_scale.numel() > 1:  # given per-token scales (a row-parallel rank's)
        x_scale = input_scale.float().reshape(m, 1).contiguous()
        q = to_fp8(x2, x_scale)
    else:
        q, x_scale = quantize_rows(x2, input_scale)
    if m >= SCALED_MM_MIN_ROWS and x.is_cuda and scaled_mm_runs(m, n, k, x.dtype):
        y = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = fp8_gemm(q, weight, x_scale, weight_scale, bias, x.dtype)
    return y.view(*x.shape[:-1], n)
