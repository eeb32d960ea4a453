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
``ALIGN_KERNEL_MAX_PAIRS``.

``--engine fused|loop`` instead runs workloads b (1,000 requests, 1,024 in / 128 out) and c
(500 requests, 128 in / 2,048 out) of ``sonar bench suite`` through the whole engine on a
Qwen3-30B-A3B-shaped model with random weights (``load_format="dummy"``): ``fused`` as the
CUDA platform runs it (decode steps in CUDA graphs), ``loop`` with ``loop_over_experts`` behind
``sonar.moe.fused_moe`` (it reads the routing on the host, so no graphs: ``SONAR_ENFORCE_EAGER``).
``--scale`` runs a fraction of each workload's requests (one for both, or ``b=0.1,c=0.02``). One variant per process. ``--sweep`` also tries every launch of
``SWEEP`` per token count. JSON (one object, ``rows`` per token count) to ``--out``.

    python sonar-cuda/benchmarks/moe.py [--tokens 1 64 256 2048] [--sweep] [--out moe.json]
    python sonar-cuda/benchmarks/moe.py --engine fused [--scale 0.25] [--out moe-engine-fused.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

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


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": HIDDEN,
    "intermediate_size": 6144, "moe_intermediate_size": INTERMEDIATE, "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# (requests, prompt tokens, output tokens) of bench suite's b and c
ENGINE_WORKLOADS = {"b": (1000, 1024, 128), "c": (500, 128, 2048)}


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
                timings.append((time_us(graphed(lambda launch=launch: fused_moe(x, w13, w2, weights, ids, launch))), launch))
            except (triton.runtime.errors.OutOfResources, RuntimeError) as error:  # too many stages for shared memory
                print(f"  {launch}: {type(error).__name__}", file=sys.stderr)
        timings.sort(key=lambda item: item[0])
        row["sweep_best"] = [{"us": round(us, 2), "launch": repr(launch)} for us, launch in timings[:5]]
    return row


def parse_scale(text: str) -> dict[str, float]:
    """``--scale``: one fraction for every workload (``0.25``) or one per workload (``b=0.1,c=0.02``)."""
    try:
        if "=" not in text:
            return dict.fromkeys(ENGINE_WORKLOADS, float(text))
        scales = {key.strip(): float(value) for key, value in (part.split("=", 1) for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale {text!r}: give a fraction or workload=fraction pairs, e.g. b=0.1,c=0.02") from None
    unknown = set(scales) - set(ENGINE_WORKLOADS)
    if unknown:
        raise argparse.ArgumentTypeError(f"--scale names unknown workloads {sorted(unknown)}; they are {sorted(ENGINE_WORKLOADS)}")
    return {key: scales.get(key, 1.0) for key in ENGINE_WORKLOADS}


def run_engine(variant: str, scales: dict[str, float]) -> dict:
    """Workloads b and c through the engine with the experts run by ``variant``."""
    if variant == "loop":
        os.environ["SONAR_ENFORCE_EAGER"] = "1"  # before the engine reads it
    from sonar import LLM, SamplingParams, ops
    from sonar.cli.bench import random_workload

    folder = Path(tempfile.mkdtemp(prefix="sonar-moe-"))
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    started = time.perf_counter()
    llm = LLM(
        str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2304,
        gpu_memory_utilization=0.88, enable_prefix_caching=False, max_num_batched_tokens=8192, max_num_seqs=1024,
    )  # fmt: skip
    load_s = time.perf_counter() - started
    if variant == "loop":
        ops.register_ops("cuda", {"fused_moe": loop_over_experts})
    vocab = QWEN3_30B_A3B["vocab_size"]

    def generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in output_lens]
        torch.cuda.synchronize()
        begun = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        torch.cuda.synchronize()
        return time.perf_counter() - begun, sum(len(o.outputs[0].token_ids) for o in outputs)

    generate(random_workload(16, (8, 64), (8, 16), vocab, 1).prompts, [16] * 16)  # warm-up: compiles
    result = {"variant": variant, "model": "Qwen3-30B-A3B-shaped, dummy bf16 weights", "load_s": round(load_s, 1), "workloads": {}}
    for key, (num_prompts, prompt_len, output_len) in ENGINE_WORKLOADS.items():
        count = max(1, round(num_prompts * scales[key]))
        workload = random_workload(count, (prompt_len, prompt_len), (output_len, output_len), vocab, 0)
        elapsed, num_output = generate(workload.prompts, workload.output_lens)
        result["workloads"][key] = {
            "requests": count, "prompt_tokens": count * prompt_len, "output_tokens": num_output,
            "elapsed_s": round(elapsed, 2), "output_tok_s": round(num_output / elapsed, 1),
        }  # fmt: skip
        print(f"{variant} {key}: {count} requests, {num_output / elapsed:,.1f} output tok/s ({elapsed:.1f} s)", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    parser.add_argument("--sweep", action="store_true", help="also time every launch in SWEEP")
    parser.add_argument("--engine", choices=("fused", "loop"), default=None, help="workloads b and c through the engine instead")
    parser.add_argument("--scale", type=parse_scale, default="1", help="--engine: fraction of each workload's requests (0.25, or b=0.1,c=0.02)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU", file=sys.stderr)
        return 1
    if args.engine:
        result = run_engine(args.engine, args.scale)
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return 0
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
