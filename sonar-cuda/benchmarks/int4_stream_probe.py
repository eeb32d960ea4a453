"""What bounds the one-row int4 products: the same weight bytes streamed with each launch's
tiling and no arithmetic, beside the nibble-plane kernel at the same launches.

    python sonar-cuda/benchmarks/int4_stream_probe.py [--out probe.json]

Weights in the int4 runtime layout (``qweight`` int32 ``[N, K / 8]``) at Llama-3.1-8B's gate_up
(28,672 x 4,096) and qkv (6,144 x 4,096) shapes, copies together larger than L2, each case
timed as a CUDA graph (``sonar_cuda.graph_timing``). Streams: ``tiles`` (a program per
``rows x runs`` tile: its rows' words a run of 16 at a time, as the plane kernel reads them,
with ``stages`` for the pipeliner) and ``flat`` (a program per contiguous span, as a copy reads).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.int4_unit import Int4Launch, int4_planes

RUN_W = tl.constexpr(16)
COPY_BYTES = 300e6
SHAPES = {"gate_up": (28672, 4096), "qkv": (6144, 4096), "down": (4096, 14336)}


@triton.jit
def _stream_tiles_kernel(w_ptr, out_ptr, N, KW: tl.constexpr, RUNS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KW + tl.arange(0, RUN_W)[None, :]
    acc = tl.zeros([BLOCK_N, RUN_W], tl.int32)
    for i in range(RUNS):
        acc ^= tl.load(w_rows + (pid_k * RUNS + i) * RUN_W, mask=(rows < N)[:, None], other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid_k * N + rows, tl.xor_sum(acc, axis=1), mask=rows < N)


@triton.jit
def _stream_flat_kernel(w_ptr, out_ptr, SPAN: tl.constexpr, CHUNK: tl.constexpr):
    base = w_ptr + tl.program_id(0).to(tl.int64) * SPAN + tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    for start in range(0, SPAN, CHUNK):
        acc ^= tl.load(base + start, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


def stream_tiles(w: torch.Tensor, out: torch.Tensor, block_n: int, split: int, warps: int, stages: int) -> None:
    n, kw = w.shape
    runs = kw // RUN_W // split
    _stream_tiles_kernel[(triton.cdiv(n, block_n), split)](w, out, n, KW=kw, RUNS=runs, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def stream_flat(w: torch.Tensor, out: torch.Tensor, programs: int, chunk: int, warps: int, stages: int) -> None:
    span = w.numel() // programs
    _stream_flat_kernel[(programs,)](w, out, SPAN=span, CHUNK=chunk, num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {"device": torch.cuda.get_device_name(), "sms": sms, "cases": {}}
    for name, (n, k) in SHAPES.items():
        kw = k // 8
        nbytes = n * kw * 4
        copies = max(2, int(COPY_BYTES // nbytes))
        ws = [torch.randint(-(2**31), 2**31 - 1, (n, kw), dtype=torch.int32, device="cuda") for _ in range(copies)]
        out = torch.empty(64 * n + 4096, dtype=torch.int32, device="cuda")
        cases = {}

        def timed(label, fn):
            us = graph_us([lambda w=w: fn(w) for w in ws])
            cases[label] = {"us": us, "TB/s": round(nbytes / us / 1e6, 2)}
            print(name, label, cases[label], flush=True)

        runs = kw // RUN_W
        for block_n, warps in ((512, 8), (256, 8), (128, 4), (32, 4)):
            for split in (1, 4, 8):
                if runs % split or runs // split < 2:
                    continue
                for stages in (1, 3):
                    timed(f"tiles n{block_n} w{warps} k{split} s{stages}", lambda w, b=block_n, sp=split, wa=warps, st=stages: stream_tiles(w, out, b, sp, wa, st))
        total = n * kw
        for programs in (128, 256, 512):  # powers of two: every shape's words split into whole spans of whole chunks
            for chunk, warps in ((2048, 8),):
                if total % programs or (total // programs) % chunk:
                    continue
                for stages in (1, 3):
                    timed(f"flat p{programs} c{chunk} w{warps} s{stages}", lambda w, p=programs, c=chunk, wa=warps, st=stages: stream_flat(w, out, p, c, wa, st))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        groups = k // 128
        sz = [((torch.rand(groups, n, device="cuda") * 0.02).to(torch.bfloat16), torch.randint(0, 16, (groups, n), device="cuda").to(torch.bfloat16))]
        for block_n, warps in ((512, 8), (256, 8), (128, 4)):
            for split in (0, 1, 4):
                for stages in (3, 4):
                    launch = Int4Launch(block_n=block_n, num_warps=warps, num_stages=stages, split_k=split)
                    try:
                        timed(f"planes n{block_n} w{warps} k{split} s{stages}", lambda w, la=launch: int4_planes(x, w, sz[0][0], sz[0][1], 128, None, la))
                    except Exception as exc:  # noqa: BLE001 - a launch that does not fit is reported
                        cases[f"planes n{block_n} w{warps} k{split} s{stages}"] = repr(exc)[:200]
        result["cases"][name] = cases
        ws.clear()
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
