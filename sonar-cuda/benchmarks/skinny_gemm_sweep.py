"""An experiment, not used by the engine: a Triton product for 9-64 activation rows (decode at
batch 9-64) against cuBLAS on Llama-3.1-8B's projections (bf16, cold weights, in a CUDA graph).

Each program owns ``BLOCK_N`` output columns over one slice of the inputs and multiplies its
weight tile by the whole activation block, so every weight byte is read once per step; inputs
are split where the columns alone are too few programs for the GPU. On an H200 it lost to
cuBLAS on qkv, o and down and won on gate_up by about 6% (docs/benchmarks.md, "Serving"), too
little to carry a second product path.

    python sonar-cuda/benchmarks/skinny_gemm_sweep.py --rows 16,32,64 --output-json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.splitk import _device_sms, sum_splits


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """A launch shape: output columns per program, inputs per step, input split, warps, stages."""

    block_n: int = 128
    block_k: int = 128
    split_k: int | None = None  # None: chosen from the program count
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    K_SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = split * K_SLICE
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_tile = x_ptr + rows[None, :] * stride_xm + ks[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, K_SLICE // BLOCK_K):
        k = k_begin + step * BLOCK_K
        if EVEN:
            w = tl.load(w_tile + k, eviction_policy="evict_first")
            x = tl.load(x_tile + k, mask=row_mask[None, :], other=0.0)
        else:
            k_mask = k + ks < K
            w = tl.load(w_tile + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_tile + k, mask=row_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(w, x)
    out_mask = col_mask[:, None] & row_mask[None, :]
    if SPLIT:
        offsets = split.to(tl.int64) * M * N + rows[None, :] * N + cols[:, None]
        tl.store(part_ptr + offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + rows[None, :] * stride_ym + cols[:, None]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _split_for(num_tiles: int, k: int, config: SkinnyConfig, num_sms: int) -> int:
    if config.split_k is not None:
        return config.split_k
    split = 1  # about two programs per multiprocessor, each slice at least 4 steps long
    while num_tiles * split < 2 * num_sms and k // (2 * split * config.block_k) >= 4:
        split *= 2
    return split


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` for ``M`` of 9-64 rows (see
    :func:`skinny_supported`), accumulated in float32, in ``x``'s dtype."""
    config = config or SkinnyConfig()
    m, k = x.shape
    n = weight.shape[0]
    num_tiles = triton.cdiv(n, config.block_n)
    sms = _device_sms(x.device.index or 0) if x.device.type == "cuda" else 4
    split = _split_for(num_tiles, k, config, sms)
    k_slice = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_slice)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    even = n % config.block_n == 0 and k % k_slice == 0
    _skinny_gemm_kernel[(num_tiles, split)](
        x, weight, bias if bias is not None else weight, y, part,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0), K_SLICE=k_slice,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT=split > 1, HAS_BIAS=bias is not None, EVEN=even,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        sum_splits(part, bias, y)
    return y

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    configs = [
        SkinnyConfig(block_n=bn, block_k=bk, split_k=None, num_warps=w, num_stages=s)
        for bn, bk, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))
    ]
    results: dict[str, dict] = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, int(4e8 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expect = x @ weights[0].t()
            entry: dict = {"cublas_us": graph_us([lambda w=w: torch.mm(x, w.t()) for w in weights])}
            best = None
            for config in configs:
                try:
                    got = skinny_gemm(x, weights[0], None, config)
                except Exception as error:  # a launch shape this GPU cannot hold (shared memory)
                    entry[str(config)] = type(error).__name__
                    continue
                if not torch.allclose(got.float(), expect.float(), atol=0.5, rtol=0.02):
                    entry[str(config)] = "WRONG"
                    continue
                us = graph_us([lambda w=w: skinny_gemm(x, w, None, config) for w in weights])
                entry[f"bn{config.block_n} bk{config.block_k} w{config.num_warps} s{config.num_stages}"] = us
                if best is None or us < best[0]:
                    best = (us, config)
            entry["best"] = [best[0], str(best[1])] if best else None
            entry["best_TB/s"] = round(n * k * 2 / best[0] / 1e6, 2) if best else None
            entry["cublas_TB/s"] = round(n * k * 2 / entry["cublas_us"] / 1e6, 2)
            results[f"{name} m={m}"] = entry
            print(name, m, "cublas", entry["cublas_us"], "best", entry["best"], flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
