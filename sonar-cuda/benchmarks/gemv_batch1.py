"""Batch-1 matrix-vector products of Llama-3.1-8B and Qwen3-0.6B, the library against Sonar's.

    python sonar-cuda/benchmarks/gemv_batch1.py

For each projection, bf16: microseconds per product and the weight-read rate of ``F.linear``
(cuBLAS) and of ``sonar_cuda.kernels.gemv``. Each is timed as a CUDA graph of many products
over distinct copies of the weight (together larger than L2), as the decode graph runs them:
timing single launches from Python measures the host's launch rate instead, and repeating one
weight measures L2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.gemv import gemv, gemv_pays

SHAPES = {
    "Llama-3.1-8B qkv": (6144, 4096), "Llama-3.1-8B o": (4096, 4096), "Llama-3.1-8B gate_up": (28672, 4096),
    "Llama-3.1-8B down": (4096, 14336), "Llama-3.1-8B lm_head": (128256, 4096),
    "Qwen3-0.6B qkv": (4096, 1024), "Qwen3-0.6B o": (1024, 2048), "Qwen3-0.6B gate_up": (6144, 1024),
    "Qwen3-0.6B down": (1024, 3072), "Qwen3-0.6B lm_head": (151936, 1024),
}
BYTES_PER_SHAPE = 600e6  # the copies of one weight, together: beyond the 50 MB L2




def main() -> None:
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(BYTES_PER_SHAPE // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        library = graph_us([lambda w=w, x=x: F.linear(x, w) for w in weights])
        ours = graph_us([lambda w=w, x=x: gemv(x, w) for w in weights])
        served = "used" if gemv_pays(weights[0]) else "not used (library)"
        print(f"{name:22} [{n} x {k}] {mb:7.1f} MB  cuBLAS {library:7.2f} us ({mb / library:4.2f} TB/s)"
              f"  gemv {ours:7.2f} us ({mb / ours:4.2f} TB/s), {served}", flush=True)
        del weights


if __name__ == "__main__":
    main()
