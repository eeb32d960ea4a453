"""The one-row FP8 products per Llama-3.1-8B projection: the GEMV that quantizes its row itself
against the prepared GEMV that reads a row the norm already quantized, beside bf16.

    python sonar-cuda/benchmarks/fp8_prepared_gemv.py [--out prepared.json]

Microseconds per product, each timed as a CUDA graph over weight copies together larger than
L2 (``sonar_cuda.graph_timing``), and the TB/s of FP8 weight bytes; the prepared GEMV at 1, 2
and 4 output rows a program.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sonar.quantization.fp8 import quantize_per_row
from sonar_cuda import ops as cuda_ops
from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.fp8_gemv import fp8_gemv, fp8_gemv_prepared
from sonar_cuda.kernels.fp8_linear import GEMV_TILES
from sonar_cuda.kernels.fp8_quant import quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPY_BYTES = 300e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "us": {}}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(COPY_BYTES // (n * k)))
        fp8 = [quantize_per_row(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(copies)]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        q, x_scale = quantize_rows(x)
        case = {
            "bf16": graph_us([lambda w=w: cuda_ops.linear(x, w) for w in bf16]),
            "fused": graph_us([lambda w=w, s=s: fp8_gemv(x, w, s, None, None, *GEMV_TILES.get((n, k), (0, 0, -1))) for w, s in fp8]),
        }
        for rows in (1, 2, 4):
            case[f"prepared_r{rows}"] = graph_us([lambda w=w, s=s, r=rows: fp8_gemv_prepared(q, x_scale, w, s, None, x.dtype, r) for w, s in fp8])
        case["TB/s"] = {label: round(n * k / us / 1e6, 2) for label, us in case.items() if label != "bf16"}
        result["us"][name] = case
        print(name, json.dumps(case), flush=True)
        fp8.clear()
        bf16.clear()
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
