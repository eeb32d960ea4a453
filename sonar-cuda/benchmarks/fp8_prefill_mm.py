"""FP8 products at prefill sizes: what a step of many tokens pays per Llama-3.1-8B projection.

    python sonar-cuda/benchmarks/fp8_prefill_mm.py [--rows 256,2048,8192] [--out prefill.json]

Per shape and row count, microseconds (CUDA events, median of the timed repeats) and TFLOP/s:

- ``bf16``: ``torch.mm`` (cuBLAS), the unquantized peer;
- ``rowwise``: ``torch._scaled_mm`` with a scale per token and per output row, what
  ``fp8_linear`` runs from 17 rows (CUTLASS on Hopper);
- ``tensorwise``: ``torch._scaled_mm`` with one scale for each operand (cuBLASLt), the
  fastest FP8 product there is, for comparison;
- ``quantize``: ``quantize_rows``, the per-token activation quantization launch before each
  row-wise product whose input no norm quantized.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sonar.quantization.fp8 import quantize_per_row
from sonar_cuda.kernels.fp8_quant import quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed_us(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256,2048,8192")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "us": {}}
    print(f"{'product':>8} {'rows':>6} {'bf16':>14} {'rowwise':>14} {'tensorwise':>14} {'quantize':>9}   (us, TFLOP/s)")
    for name, (n, k) in SHAPES.items():
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w_fp8, w_scale = quantize_per_row(w_bf16.float())
        w_scale_row = w_scale.float().reshape(1, n).contiguous()
        one = torch.ones((), device="cuda")
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, x_scale = quantize_rows(x)
            flop = 2.0 * m * n * k
            us = {
                "bf16": timed_us(lambda: torch.mm(x, w_bf16.t())),
                "rowwise": timed_us(lambda: torch._scaled_mm(q, w_fp8.t(), scale_a=x_scale, scale_b=w_scale_row, out_dtype=torch.bfloat16)),
                "tensorwise": timed_us(lambda: torch._scaled_mm(q, w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
                "quantize": timed_us(lambda: quantize_rows(x)),
            }
            result["us"][f"{name}:{m}"] = us
            cells = "".join(f" {us[c]:8.1f} {flop / us[c] / 1e6:5.0f}" for c in ("bf16", "rowwise", "tensorwise"))
            print(f"{name:>8} {m:6d}{cells} {us['quantize']:9.1f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
