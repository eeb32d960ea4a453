"""FP8 W8A8 on Llama-3.1-8B shapes: the GEMM choice per shape, and batch-1 decode against bf16.

    python sonar-cuda/benchmarks/fp8_decode.py [--part gemv|gemm|tpot|profile|all] [--out summary.json]

gemv: M = 1 only, microseconds and weight TB/s per projection: bf16 (``sonar_cuda.ops.linear``),
the FP8 GEMV at its default tile and a sweep of tiles, the first FP8 GEMV's loop (amax before
the weight loads: the split-K kernel unsplit) and quantize + Triton GEMM.
gemm: for each projection of Llama-3.1-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336) and M = 1, 16, 128, 1024 rows, microseconds per product (activation
quantization included) of ``torch._scaled_mm`` (row-wise scales), the Triton tiled GEMM, the
fused Triton GEMV (M = 1, a few tile shapes) and bf16 (``sonar_cuda.ops.linear``), each timed
as a CUDA graph over copies of the weight that together exceed L2, as decode runs them.
tpot: ``LLM`` on dummy Llama-3.1-8B weights, bf16 and ``quantization="fp8"`` in the same run:
milliseconds per output token at batch 1 (a 32-token prompt; the time of 16 + 128 output
tokens minus that of 16, over 128; best of 3). Prints one compact JSON summary.
profile: for bf16 and FP8 in turn, TPOT as above, the device time of one replay of the batch-1
decode graph (CUDA events) and, under the torch profiler, the kernels of 10 replays plus the
head, and those of one generate() call (how many graph launches, what runs eagerly).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from sonar_cuda.graph_timing import graph_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 128, 1024)
BYTES_PER_CASE = 400e6  # the copies of one weight, together: beyond the 50 MB L2
# (rows per program, warps, programs per multiprocessor or 0 for a program per tile)
GEMV_TILES = ((2, 8, 0), (4, 4, 0), (4, 8, 0), (8, 8, 0), (8, 16, 0), (4, 4, 8), (8, 8, 4), (2, 8, 2), (2, 4, 2), (4, 16, 2))
GEMM_TILES = ((16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 32, 512, 4, 3), (16, 64, 128, 4, 6), (16, 128, 256, 4, 3))


def weight_copies(n: int, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """FP8 copies of an ``n x k`` weight filling ``BYTES_PER_CASE`` (so each timed product reads
    from memory, not L2), bf16 copies of half of them, and a per-row scale."""
    copies = max(2, int(BYTES_PER_CASE // (n * k)))
    weights = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn) for _ in range(copies)]
    bf16 = [w.to(torch.bfloat16) for w in weights[: max(2, copies // 2)]]
    return weights, bf16, torch.full((n,), 0.01, device="cuda")


def gemm_sweep() -> dict:
    from sonar_cuda import ops as cuda_ops
    from sonar_cuda.kernels.fp8_gemm import fp8_gemm
    from sonar_cuda.kernels.fp8_gemv import fp8_gemv
    from sonar_cuda.kernels.fp8_linear import fp8_linear
    from sonar_cuda.kernels.fp8_quant import quantize_rows

    results: dict = {}
    for name, (n, k) in SHAPES.items():
        weights, bf16, scale = weight_copies(n, k)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def scaled_mm(w, x=x):
                q, s = quantize_rows(x)
                return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scale.view(1, n), out_dtype=torch.bfloat16)

            def triton_gemm(w, x=x):
                q, s = quantize_rows(x)
                return fp8_gemm(q, w, s, scale, None, torch.bfloat16)

            case = {
                "bf16": graph_us([lambda w=w, x=x: cuda_ops.linear(x, w) for w in bf16]),
                "scaled_mm": graph_us([lambda w=w: scaled_mm(w) for w in weights]),
                "triton_gemm": graph_us([lambda w=w: triton_gemm(w) for w in weights]),
                "dispatch": graph_us([lambda w=w, x=x: fp8_linear(x, w, scale, None) for w in weights]),
            }
            if m <= 16:
                for tile in GEMM_TILES:
                    case["triton_" + "x".join(map(str, tile))] = graph_us(
                        [lambda w=w, x=x, tile=tile: (lambda q, s: fp8_gemm(q, w, s, scale, None, torch.bfloat16, tile))(*quantize_rows(x)) for w in weights]
                    )
            if m == 1:
                case["gemv"] = graph_us([lambda w=w, x=x: fp8_gemv(x, w, scale, None) for w in weights])
            case["gbps_dispatch"] = round(n * k / case["dispatch"] / 1e3, 1)
            results[f"{name} M={m}"] = case
            print(name, m, case, flush=True)
        del weights, bf16
        torch.cuda.empty_cache()
    return results


def gemv_sweep() -> dict:
    from sonar_cuda import ops as cuda_ops
    from sonar_cuda.kernels.fp8_gemm import fp8_gemm
    from sonar_cuda.kernels.fp8_gemv import fp8_gemv
    from sonar_cuda.kernels.fp8_gemv_splitk import Fp8GemvLaunch, fp8_gemv_splitk
    from sonar_cuda.kernels.fp8_linear import fp8_linear
    from sonar_cuda.kernels.fp8_quant import quantize_rows

    results: dict = {}
    for name, (n, k) in SHAPES.items():
        weights, bf16, scale = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        first = Fp8GemvLaunch(block_n=8, block_k=1024, split_k=1, num_warps=4)
        case = {
            "bf16": graph_us([lambda w=w: cuda_ops.linear(x, w) for w in bf16]),
            "dispatch": graph_us([lambda w=w: fp8_linear(x, w, scale, None) for w in weights]),
            "gemv_default": graph_us([lambda w=w: fp8_gemv(x, w, scale, None) for w in weights]),
            "first_gemv_8x1024w4": graph_us([lambda w=w: fp8_gemv_splitk(x, w, scale, None, None, first) for w in weights]),
            "quant_triton_gemm": graph_us(
                [lambda w=w: (lambda q, s: fp8_gemm(q, w, s, scale, None, torch.bfloat16))(*quantize_rows(x)) for w in weights]
            ),
        }
        for bn, warps, per_sm in GEMV_TILES:
            if bn * triton_next_pow2(k) <= 65536:
                case[f"gemv_{bn}w{warps}x{per_sm}"] = graph_us(
                    [lambda w=w, bn=bn, warps=warps, per_sm=per_sm: fp8_gemv(x, w, scale, None, None, bn, warps, per_sm) for w in weights]
                )
        fastest = min((v, key) for key, v in case.items() if key.startswith("gemv_"))
        case["fastest_gemv"] = fastest[1]
        case["tbps_dispatch"] = round(n * k / case["dispatch"] / 1e6, 2)
        case["tbps_fastest_gemv"] = round(n * k / fastest[0] / 1e6, 2)
        case["tbps_bf16"] = round(2 * n * k / case["bf16"] / 1e6, 2)
        results[name] = case
        print(name, case, flush=True)
        del weights, bf16
        torch.cuda.empty_cache()
    return results


def triton_next_pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}


def tpot_ms(folder: Path, **options) -> float:
    from sonar import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.85, max_num_seqs=4, enable_prefix_caching=False, **options)
    prompt = [{"prompt_token_ids": list(range(1000, 1032))}]

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    seconds(16)
    best = min(seconds(16 + 128) - seconds(16) for _ in range(3))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return round(1000 * best / 128, 3)


def _kernel_table(prof: torch.profiler.profile, per: int) -> list[dict]:
    rows = [
        {"kernel": e.key[:90], "calls": e.count / per, "us": round(e.self_device_time_total / per, 1)}
        for e in prof.key_averages() if e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["us"])


def profile_decode(folder: Path, **options) -> dict:
    """TPOT, the batch-1 decode graph's device time and the kernels of a batch-1 decode step."""
    from sonar import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.85, max_num_seqs=4, enable_prefix_caching=False, **options)
    prompt = [{"prompt_token_ids": list(range(1000, 1032))}]

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    seconds(16)
    out: dict = {"tpot_ms": round(1000 * min(seconds(16 + 128) - seconds(16) for _ in range(3)) / 128, 3)}
    runner = llm.llm_engine.core.executor.worker.model_runner
    graphs = runner.graphs
    out["graph_sizes"] = sorted(graphs.graphs) if graphs is not None else []
    model = runner.model
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        hidden = graphs.run(1)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            graphs.run(1)
        end.record()
        torch.cuda.synchronize()
        out["graph_replay_ms"] = round(start.elapsed_time(end) / 20, 3)
        start.record()
        for _ in range(20):
            model.compute_logits(hidden[:1])
        end.record()
        torch.cuda.synchronize()
        out["head_ms"] = round(start.elapsed_time(end) / 20, 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                model.compute_logits(graphs.run(1)[:1])
            torch.cuda.synchronize()
        out["replay_kernels"] = _kernel_table(prof, 10)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            graphs._forward(1)  # eager: every launch of one step
            torch.cuda.synchronize()
        out["eager_kernels"] = _kernel_table(prof, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
        out["generate_33_s"] = round(time.perf_counter() - started, 4)
    out["generate_ops"] = [
        {"op": e.key[:90], "calls": e.count, "cpu_us": round(e.cpu_time_total), "dev_us": round(e.self_device_time_total)}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total - e.cpu_time_total)[:40]
    ]
    del llm, runner, graphs, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("gemv", "gemm", "tpot", "profile", "all"), default="all")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--configs", default="fp8,bf16", help="profile: which models, in order (fp8, bf16)")
    args = parser.parse_args()
    summary: dict = {"device": torch.cuda.get_device_name()}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))

    if args.part in ("tpot", "profile", "all"):
        with tempfile.TemporaryDirectory() as root:
            folder = Path(root)
            (folder / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
            if args.part == "profile":
                for label in args.configs.split(","):
                    options = {"quantization": "fp8"} if label == "fp8" else {}
                    summary[f"profile_{label}"] = profile = profile_decode(folder, **options)
                    save()
                    print(label, {k: v for k, v in profile.items() if not isinstance(v, list)}, flush=True)
                    for row in profile["replay_kernels"][:25]:
                        print("   ", row, flush=True)
                return
            summary["tpot_ms_fp8"] = tpot_ms(folder, quantization="fp8")
            save()
            summary["tpot_ms_bf16"] = tpot_ms(folder)
            save()
            print(json.dumps({k: summary[k] for k in ("tpot_ms_fp8", "tpot_ms_bf16")}), flush=True)
    if args.part == "gemv":
        summary["gemv_us"] = gemv_sweep()
        save()
    if args.part in ("gemm", "all"):
        summary["gemm_us"] = gemm_sweep()
        save()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
