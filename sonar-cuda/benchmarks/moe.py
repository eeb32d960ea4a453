"""The fused MoE kernel against a loop over experts, on one Qwen3-30B-A3B-shaped layer.

128 experts, top 8, hidden 2048, expert intermediate 768, bfloat16 random weights; the router
is a random linear layer over random activations (a softmax, top 8, renormalised), so each
token count touches the experts real routing would about touch. Per token count (1 and 64:
decode-like; 256 and 2048: prefill-like) it times, with the L2 cache flushed before every run:

- ``fused``: ``sonar_cuda.kernels.fused_moe.fused_moe`` as called (sort, align, two grouped GEMMs);
- ``fused_graph``: the same captured in a CUDA graph (how the engine's decode steps run it);
- ``loop``: ``loop_over_experts``, each expert's tokens picked by mask and run through cuBLAS;
- ``torch_grouped``: ``sonar.moe.torch_fused_moe`` (the CPU path: pairs sorted, one pair of
  products per active expert).

Beside each: the memory floor, the bytes of the experts the step touches (plus activations)
over 4.8 TB/s, and the compute floor at 989 TFLOP/s; and, graphed, the alignment alone
(``align_us``: what ``align_by_expert`` picks; ``align_sort_us``: the device sort), to place
``ALIGN_KERNEL_MAX_PAIRS``. ``--sweep`` also tries every launch of
``SWEEP`` per token count. JSON (one object, ``rows`` per token count) to ``--out``.

    python sonar-cuda/benchmarks/moe.py [--tokens 1 64 256 2048] [--sweep] [--out moe.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton

from sonar.moe import torch_fused_moe
from sonar_cuda.kernels import fused_moe as fused_moe_module
from sonar_cuda.kernels.fused_moe import MoELaunch, align_by_expert, fused_moe, launch_for, loop_over_experts

HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
HBM_BYTES_PER_S = 4.8e12  # H200
BF16_FLOP_PER_S = 989e12  # H200 dense bf16
SWEEP = [
    MoELaunch(block_m, block_n, block_k, num_warps, num_stages)
    for block_m, block_n, block_k, num_warps, num_stages in itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8), (3, 4))
]


def make_layer(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen, device=device, dtype=dtype) * HIDDEN**-0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen, device=device, dtype=dtype) * INTERMEDIATE**-0.5
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen, device=device, dtype=dtype) * HIDDEN**-0.5
    return w13, w2, router


def make_tokens(num_tokens: int, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=router.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=router.device, dtype=router.dtype)
    probs = torch.softmax(torch.nn.functional.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).to(x.dtype), ids


def time_us(fn) -> float:
    """Median microseconds of ``fn``, the L2 cache flushed before every run."""
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graphed(fn):
    """``fn`` captured once in a CUDA graph; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor, sweep: bool) -> dict:
    x, weights, ids = make_tokens(num_tokens, router)
    touched = int(torch.unique(ids).numel())
    element = w13.element_size()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * element
    active_bytes = touched * expert_bytes + 2 * x.numel() * element  # touched experts, x in and out
    flops = 2 * num_tokens * TOP_K * (w13[0].numel() + w2[0].numel())
    floor_us = 1e6 * active_bytes / HBM_BYTES_PER_S
    row = {
        "tokens": num_tokens,
        "experts_touched": touched,
        "active_MB": round(active_bytes / 1e6, 2),
        "memory_floor_us": round(floor_us, 2),
        "compute_floor_us": round(1e6 * flops / BF16_FLOP_PER_S, 2),
        "launch": repr(launch_for(num_tokens * TOP_K, NUM_EXPERTS, x.device)),
    }
    fused = fused_moe(x, w13, w2, weights, ids)
    reference = loop_over_experts(x, w13, w2, weights, ids)
    row["max_abs_diff_vs_loop"] = float((fused.float() - reference.float()).abs().max())
    row["fused_us"] = round(time_us(lambda: fused_moe(x, w13, w2, weights, ids)), 2)
    row["fused_graph_us"] = round(time_us(graphed(lambda: fused_moe(x, w13, w2, weights, ids))), 2)
    row["loop_us"] = round(time_us(lambda: loop_over_experts(x, w13, w2, weights, ids)), 2)
    row["torch_grouped_us"] = round(time_us(lambda: torch_fused_moe(x, w13, w2, weights, ids)), 2)
    launch = launch_for(num_tokens * TOP_K, NUM_EXPERTS, x.device)
    num_blocks = triton.cdiv(ids.numel() + min(NUM_EXPERTS, ids.numel()) * (launch.block_m - 1), launch.block_m)
    row["align_us"] = round(time_us(graphed(lambda: align_by_expert(ids, NUM_EXPERTS, launch.block_m))), 2)
    row["align_sort_us"] = round(time_us(graphed(lambda: fused_moe_module._align_by_sorting(ids, NUM_EXPERTS, launch.block_m, num_blocks))), 2)
    row["speedup_vs_loop"] = round(row["loop_us"] / row["fused_graph_us"], 2)
    row["fused_graph_TB_s"] = round(active_bytes / row["fused_graph_us"] / 1e6, 2)
    row["fused_graph_of_floor"] = round(floor_us / row["fused_graph_us"], 3)
    if sweep:
        timings = []
        for launch in SWEEP:
            try:
                fused_moe(x, w13, w2, weights, ids, launch)
                timings.append((time_us(graphed(lambda: fused_moe(x, w13, w2, weights, ids, launch))), launch))
            except (triton.runtime.errors.OutOfResources, RuntimeError) as error:  # too many stages for shared memory
                print(f"  {launch}: {type(error).__name__}", file=sys.stderr)
        timings.sort(key=lambda item: item[0])
        row["sweep_best"] = [{"us": round(us, 2), "launch": repr(launch)} for us, launch in timings[:5]]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--sweep", action="store_true", help="also time every launch in SWEEP")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    w13, w2, router = make_layer(torch.bfloat16, device)
    rows = []
    for num_tokens in args.tokens:
        row = measure(num_tokens, w13, w2, router, args.sweep)
        rows.append(row)
        print(
            f"T={num_tokens:5d} experts {row['experts_touched']:3d} ({row['active_MB']:7.1f} MB): "
            f"floor {row['memory_floor_us']:7.1f} us (compute {row['compute_floor_us']:6.1f})  "
            f"fused {row['fused_us']:7.1f}  graphed {row['fused_graph_us']:7.1f} ({row['fused_graph_TB_s']:.2f} TB/s)  "
            f"loop {row['loop_us']:8.1f}  torch grouped {row['torch_grouped_us']:8.1f}  "
            f"x{row['speedup_vs_loop']} vs loop  align {row['align_us']:.1f} (sort {row['align_sort_us']:.1f})  "
            f"|diff| {row['max_abs_diff_vs_loop']:.2e}",
            flush=True,
        )
    result = {
        "layer": {"hidden": HIDDEN, "experts": NUM_EXPERTS, "top_k": TOP_K, "moe_intermediate": INTERMEDIATE, "dtype": "bfloat16"},
        "device": torch.cuda.get_device_name(),
        "hbm_TB_s": HBM_BYTES_PER_S / 1e12,
        "rows": rows,
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
