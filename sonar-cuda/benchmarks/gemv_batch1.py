"""Batch-1 matrix-vector products of Llama-3.1-8B's layers, three ways, on the GPU.

    python sonar-cuda/benchmarks/gemv_batch1.py

Prints microseconds per call and the weight-read rate of ``F.linear`` (what the model calls),
``torch.mv`` and ``W @ x.T`` for each projection, bf16, so a faster formulation for decode
at batch 1 can be chosen from measurements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}


def time_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def main() -> None:
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bytes_read = weight.numel() * 2
        results = {
            "F.linear": time_us(lambda: F.linear(x, weight)),
            "torch.mv": time_us(lambda: torch.mv(weight, x[0])),
            "W @ x.T": time_us(lambda: weight @ x.t()),
        }
        line = "  ".join(f"{how} {us:7.1f} us ({bytes_read / us / 1e6:5.2f} TB/s)" for how, us in results.items())
        print(f"{name:8} [{n} x {k}]  {line}", flush=True)


if __name__ == "__main__":
    main()
