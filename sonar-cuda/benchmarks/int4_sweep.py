"""int4 kernels and launches per Llama-3.1-8B projection at 1, 4 and 16 rows, against bf16.

    python sonar-cuda/benchmarks/int4_sweep.py [--rows 1,4,16] [--out sweep.json] [--choices choices.json] [--budget-s 240] [--only REGEX]

For qkv 6144x4096, o 4096x4096, gate_up 28672x4096 and down 4096x14336 (GPTQ group 128, bf16
activations): microseconds per product of each candidate (``sonar_cuda.kernels.int4_gemm``'s
``Int4Choice``: the unit-float kernels' launches, the tiled GEMM) and of the bf16
product (``sonar_cuda.ops.linear``), each timed as a CUDA graph over copies of the weight that
together exceed L2, as decode streams them. ``err`` is the largest difference from the float32
dequantized product over the largest output; a candidate past ``MAX_ERROR`` is not chosen.
``--choices`` writes the fastest candidate per (rows bucket, N, K) in the form
``int4_decode.py --choices`` reads. Cases past ``--budget-s`` are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import torch

from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.int4_gemm import Int4Choice, reference_int4_linear, rows_bucket, run_choice
from sonar_cuda.kernels.int4_unit import Int4Launch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
BYTES_PER_CASE = 300e6  # the copies of one weight, together: beyond the 50 MB L2
MAX_ERROR = 0.02


ONLY: re.Pattern | None = None  # --only: the candidates whose labels match


def candidates(m: int) -> dict[str, Int4Choice]:
    every = _candidates(m)
    return every if ONLY is None else {label: choice for label, choice in every.items() if ONLY.fullmatch(label)}


def _candidates(m: int) -> dict[str, Int4Choice]:
    planes = {  # the nibble-plane tensor-core product (16-bit planes less the zero point), at every row count
        f"planes_n{n}_w{w}_s{s}{'_k' + str(k) if k else ''}{'_r' + str(r) if r > 1 else ''}": Int4Choice("planes", Int4Launch(block_n=n, num_warps=w, num_stages=s, split_k=k, runs_per_chunk=r))
        for n, w, s, k, r in (
            *((n, w, 3, k, 1) for n, w in ((64, 4), (128, 4), (256, 8), (512, 8)) for k in (0, 1, 2, 4, 8)),
            (128, 8, 3, 0, 1), (256, 8, 2, 0, 1),
            *((n, w, 3, k, r) for n, w in ((128, 4), (256, 8)) for k in (0, 1, 2) for r in (2, 4)),
        )
    }  # fmt: skip
    if m == 1:
        return {
            "unit_n8_c4": Int4Choice("unit", Int4Launch(block_n=8, runs_per_chunk=4)),
            "unit_n8_c4_p1": Int4Choice("unit", Int4Launch(block_n=8, runs_per_chunk=4, prefetch=1)),
            "unit_n8_c2_p1": Int4Choice("unit", Int4Launch(block_n=8, runs_per_chunk=2, prefetch=1)),
            "unit_n16_c2_p1": Int4Choice("unit", Int4Launch(block_n=16, runs_per_chunk=2, prefetch=1)),
            "unit_n4_c8_p1": Int4Choice("unit", Int4Launch(block_n=4, runs_per_chunk=8, prefetch=1)),
            "unit_n64_c1": Int4Choice("unit", Int4Launch(block_n=64, runs_per_chunk=1)),
            **{  # the GEMV of several output rows a thread, the activations in plane order
                f"rows_n{n}_w{w}_k{k}": Int4Choice("rows", Int4Launch(block_n=n, num_warps=w, split_k=k))
                for n in (4, 8, 16) for w in (2, 4, 8) for k in (0, 1, 2, 4)
            },
            **planes,
        }
    return {
        "tiled": Int4Choice("tiled"),
        "dot_n64": Int4Choice("unit", Int4Launch(block_n=64, num_stages=3)),
        "dot_n128_w8": Int4Choice("unit", Int4Launch(block_n=128, num_warps=8, num_stages=3)),
        **planes,
    }


def run(choice: Int4Choice, x: torch.Tensor, operands: tuple) -> torch.Tensor:
    from sonar_cuda.kernels.int4_gemm import int4_gemm, int4_gemv

    out = run_choice(choice, x, *operands, GROUP)
    if out is None:
        out = int4_gemv(x, *operands, GROUP) if x.shape[0] == 1 else int4_gemm(x, *operands, GROUP)
    return out


def sweep_shape(name: str, n: int, k: int, deadline: float, rows: tuple[int, ...] = (1, 4, 16)) -> dict:
    from sonar.quantization.int4_packing import pack_int4
    from sonar_cuda import ops as cuda_ops

    groups = k // GROUP
    copies = max(2, int(BYTES_PER_CASE // (n * k // 2)))
    int4 = [
        (pack_int4(torch.randint(0, 16, (n, k), device="cuda"), dim=1),
         (torch.rand(groups, n, device="cuda") * 0.02 + 0.001).to(torch.bfloat16),
         torch.randint(0, 16, (groups, n), device="cuda").to(torch.bfloat16))
        for _ in range(copies)
    ]  # fmt: skip
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(2, copies // 4))]
    table: dict = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        expected = reference_int4_linear(x, *int4[0], GROUP)
        case: dict = {"bf16": graph_us([lambda w=w: cuda_ops.linear(x, w) for w in bf16])}
        for label, choice in candidates(m).items():
            if time.monotonic() > deadline:
                case[label] = "skipped"
                continue
            err = ((run(choice, x, int4[0]).float() - expected).abs().max() / expected.abs().max()).item()
            case[label] = graph_us([lambda p=p, choice=choice: run(choice, x, p) for p in int4])
            case[f"{label}_err"] = round(err, 5)
        table[f"{name} M={m}"] = case
        print(json.dumps({f"{name} M={m}": case}), flush=True)
    del int4, bf16
    torch.cuda.empty_cache()
    return table


def fastest(table: dict, rows: tuple[int, ...] = (1, 4, 16)) -> list[dict]:
    """The fastest candidate within ``MAX_ERROR`` per (rows bucket, N, K)."""
    chosen = []
    for name, (n, k) in SHAPES.items():
        for m in rows:
            case = table.get(f"{name} M={m}", {})
            timed = {
                label: us for label, us in case.items()
                if label in candidates(m) and isinstance(us, float) and case.get(f"{label}_err", 1.0) <= MAX_ERROR
            }  # fmt: skip
            if not timed:
                continue
            label = min(timed, key=timed.get)
            choice = candidates(m)[label]
            launch = choice.launch
            chosen.append({
                "bucket": rows_bucket(m), "n": n, "k": k, "label": label, "us": timed[label], "bf16_us": case["bf16"],
                "kernel": choice.kernel, "launch": None if launch is None else dataclasses.asdict(launch),
            })  # fmt: skip
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--choices", type=Path, default=None, help="write the fastest candidate per shape here")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--rows", default="1,4,16", help="activation rows to time (of 1, 4, 16)")
    parser.add_argument("--only", default=None, help="a regular expression: time only the candidates whose labels match it")
    args = parser.parse_args()
    global ONLY
    ONLY = re.compile(args.only) if args.only else None
    rows = tuple(int(m) for m in args.rows.split(","))
    started = time.monotonic()
    summary: dict = {"device": torch.cuda.get_device_name(), "us": {}}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):  # an equal share of the budget per shape
        summary["us"].update(sweep_shape(name, n, k, started + args.budget_s * (i + 1) / len(SHAPES), rows))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))
    summary["fastest"] = fastest(summary["us"], rows)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.choices:
        args.choices.write_text(json.dumps(summary["fastest"], indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
