"""``sonar.ops`` operation ``fp8_linear`` on CUDA: the product kernel chosen per shape.

One row of activations, at most ``GEMV_MAX_ROWS`` outputs and ``GEMV_MAX_K`` inputs: the fused FP8
GEMV (activation quantization inside, one launch); a shape listed in ``GEMV_LAUNCHES`` takes the
split-K GEMV (``sonar_cuda.kernels.fp8_gemv_splitk``) instead. ``quant_gemv_sweep.py`` on an
H200 found none where it pays (one row, us, split-K best / unsplit GEMV / Triton GEMM: qkv
13.2 / 13.1 / 13.2, o 10.6 / 8.9 / 11.1, gate_up 50.2 / 44.3 / 34.0), so the table is empty.
Otherwise the activations are quantized by one Triton launch, then ``torch._scaled_mm`` with row-wise scales (CUTLASS on Hopper; bf16 output,
K and N multiples of 16) from ``SCALED_MM_MIN_ROWS`` rows, the Triton tiled GEMM below that
and where ``_scaled_mm`` cannot run the shape. The thresholds are what
``sonar-cuda/benchmarks/fp8_decode.py`` measured on an H200 (Llama-3.1-8B, M = 1: o 4096x4096
GEMV 10.5 us against Triton GEMM 15.3, gate_up 28672x4096 GEMM 44.5 against GEMV 56.6; M = 16:
Triton 12.3-43.5 us against _scaled_mm 16.0-48.3; M = 128: _scaled_mm 16.5-41.5 against
Triton 20.6-40.8). Nothing here synchronises with the host, so decode graphs capture it.
"""

from __future__ import annotations

import functools

import torch

from sonar.quantization.fp8 import to_fp8
from sonar_cuda.kernels.fp8_gemm import fp8_gemm
from sonar_cuda.kernels.fp8_gemv import fp8_gemv, fp8_gemv_supported
from sonar_cuda.kernels.fp8_gemv_splitk import Fp8GemvLaunch, fp8_gemv_splitk
from sonar_cuda.kernels.fp8_quant import quantize_rows

SCALED_MM_MIN_ROWS = 17
GEMV_MAX_ROWS = 8192
GEMV_MAX_K = 8192  # down 4096 x 14336 at M = 1: Triton GEMM 31.0 us against GEMV 35.5
GEMV_TILE = (8, 1024, 4)  # (rows per program, BLOCK_K, warps): qkv 13.1 us, o 8.85
GEMV_LAUNCHES: dict[tuple[int, int], Fp8GemvLaunch] = {}  # (N, K) -> a split-K launch at one row


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
) -> torch.Tensor:
    """``sonar.quantization.fp8.fp8_linear`` on CUDA tensors: same arguments, same math."""
    n, k = weight.shape
    if fp8_gemv_supported(x, weight):
        if (n, k) in GEMV_LAUNCHES:
            return fp8_gemv_splitk(x, weight, weight_scale, input_scale, bias, GEMV_LAUNCHES[(n, k)])
        if n <= GEMV_MAX_ROWS and k <= GEMV_MAX_K:
            return fp8_gemv(x, weight, weight_scale, input_scale, bias, *GEMV_TILE)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if input_scale is not None and input_scale.numel() > 1:  # given per-token scales (a row-parallel rank's)
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
