"""FP8 skinny products on Llama-3.1-8B shapes against bf16 (int4's: ``int4_sweep.py``).

    python sonar-cuda/benchmarks/quant_gemv_sweep.py [--out sweep.json] [--budget-s 170]

For qkv 6144x4096, o 4096x4096, gate_up 28672x4096 and down 4096x14336 at M = 1, 4, 16 rows:
microseconds per product of the FP8 kernels (the unsplit fused GEMV and the split-K one at one
row, the Triton GEMM for more, activation quantization included) and bf16
(``sonar_cuda.ops.linear``). Each is timed as a CUDA graph over copies of the weight that
together exceed L2, as decode streams them; ``err`` is the largest difference from the unsplit
GEMV over the largest output. Cases past ``--budget-s`` are skipped. Prints one
JSON line per shape and the whole table at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sonar_cuda.graph_timing import graph_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BYTES_PER_CASE = 300e6  # the copies of one weight, together: beyond the 50 MB L2




def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return round(((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item(), 5)


def fp8_candidates() -> dict[str, object]:
    from sonar_cuda.kernels.fp8_gemv_splitk import Fp8GemvLaunch

    return {
        "splitk_n8_k512": Fp8GemvLaunch(block_n=8, block_k=512),
        "splitk_n4_k1024": Fp8GemvLaunch(block_n=4, block_k=1024),
        "splitk_n16_k512_w8": Fp8GemvLaunch(block_n=16, block_k=512, num_warps=8),
    }


def sweep_shape(name: str, n: int, k: int, deadline: float) -> dict:
    from sonar_cuda import ops as cuda_ops
    from sonar_cuda.kernels.fp8_gemm import fp8_gemm
    from sonar_cuda.kernels.fp8_gemv import fp8_gemv
    from sonar_cuda.kernels.fp8_gemv_splitk import fp8_gemv_splitk
    from sonar_cuda.kernels.fp8_quant import quantize_rows

    fp8_copies = max(2, int(BYTES_PER_CASE // (n * k)))
    fp8 = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn) for _ in range(fp8_copies)]
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(2, fp8_copies // 2))]
    fp8_scale = torch.full((n,), 0.01, device="cuda")
    table: dict = {}
    for m in (1, 4, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        case: dict = {"bf16": graph_us([lambda w=w: cuda_ops.linear(x, w) for w in bf16])}
        # FP8
        if m == 1:
            case["fp8_gemv"] = graph_us([lambda w=w: fp8_gemv(x, w, fp8_scale, None) for w in fp8])
            expected = fp8_gemv(x, fp8[0], fp8_scale, None)
            for label, launch in fp8_candidates().items():
                if time.monotonic() > deadline:
                    case[f"fp8_{label}"] = "skipped"
                    continue
                case[f"fp8_{label}"] = graph_us([lambda w=w, launch=launch: fp8_gemv_splitk(x, w, fp8_scale, None, None, launch) for w in fp8])
                case[f"fp8_{label}_err"] = relative_error(fp8_gemv_splitk(x, fp8[0], fp8_scale, None, None, launch), expected)
        if time.monotonic() < deadline:

            def fp8_tiled(w: torch.Tensor) -> torch.Tensor:
                q, x_scale = quantize_rows(x)
                return fp8_gemm(q, w, x_scale, fp8_scale, None, torch.bfloat16)

            case["fp8_triton_gemm"] = graph_us([lambda w=w: fp8_tiled(w) for w in fp8])
        table[f"{name} M={m}"] = case
        print(json.dumps({f"{name} M={m}": case}), flush=True)
    del fp8, bf16
    torch.cuda.empty_cache()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=170.0)
    args = parser.parse_args()
    started = time.monotonic()
    summary: dict = {"device": torch.cuda.get_device_name(), "us": {}}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):  # an equal share of the budget per shape
        summary["us"].update(sweep_shape(name, n, k, started + args.budget_s * (i + 1) / len(SHAPES)))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
