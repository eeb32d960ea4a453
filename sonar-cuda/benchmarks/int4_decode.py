"""int4 (GPTQ, group 128) decode against bf16 on Llama-3.1-8B random weights, in one run.

Both engines load ``load_format="dummy"`` from the same config folder; the int4 one's config
carries a GPTQ ``quantization_config``, so its projections are drawn directly in the runtime
layout (random 4-bit values, scales and zero points). Decode time per token is the time of
``short + N`` output tokens minus the time of ``short``, over ``N`` (prefill excluded):

- batch 1: TPOT in ms (acceptance: int4 <= 1.6 ms; the floor is ~1.1 ms for ~4.5 GB read);
- batch 16: decode tok/s (acceptance: int4 no slower than bf16).

``--sweep`` also times the GEMV and GEMM launches per Llama-3.1-8B shape and block choice.
``--choices F`` (written by ``int4_sweep.py --choices``) also measures an int4 engine whose
products of 1 to 16 rows run the kernels F names per shape, beside the one with the defaults.
Prints one JSON summary line at the end.

    python sonar-cuda/benchmarks/int4_decode.py [--sweep] [--choices F] [--output-json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from sonar import LLM, SamplingParams
from sonar.cli.bench_suite import MODELS

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
SHORT, EXTRA, PROMPT_LEN = 8, 128, 32


def write_config(root: Path, quantized: bool) -> Path:
    folder = root / ("gptq" if quantized else "bf16")
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(MODELS["Llama-3.1-8B"])
    if quantized:
        config["quantization_config"] = GPTQ_CONFIG
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(PROMPT_LEN)]} for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def decode_ms_per_step(llm: LLM, batch: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        short, long = run(llm, batch, SHORT), run(llm, batch, SHORT + EXTRA)
        best = min(best, (long - short) / EXTRA)
    return 1000 * best


def measure_engine(folder: Path) -> dict[str, float]:
    started = time.perf_counter()
    llm = LLM(
        str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
        kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False, max_num_seqs=16,
    )  # fmt: skip
    load_s = time.perf_counter() - started
    allocated = torch.cuda.memory_allocated()  # weights, the 4 GiB KV cache, graph pools
    run(llm, 16, 16)  # warm-up: compiles and graphs
    run(llm, 1, 16)
    tpot = decode_ms_per_step(llm, 1)
    step16 = decode_ms_per_step(llm, 16)
    result = {"load_s": round(load_s, 1), "tpot_ms": round(tpot, 3), "batch16_ms_per_step": round(step16, 3), "batch16_tok_s": round(16_000 / step16, 1)}
    result["allocated_gb"] = round(allocated / 1e9, 2)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def time_us(fn, repeats: int = 50) -> float:
    """Median microseconds of ``fn`` replayed in a CUDA graph (weights cold: L2 flushed each time)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def sweep() -> dict[str, dict[str, float]]:
    from sonar_cuda.kernels.int4_gemm import int4_gemm, int4_gemv

    results: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        scales = torch.rand(k // 128, n, device="cuda", dtype=torch.bfloat16) * 0.01
        zeros = torch.full((k // 128, n), 8.0, device="cuda", dtype=torch.bfloat16)
        bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        row = {"bytes_int4_mb": round((qweight.numel() * 4 + scales.numel() * 4) / 1e6, 1)}
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row["bf16_gemv_us"] = round(time_us(lambda: torch.nn.functional.linear(x1, bf16)), 1)
        for block_n, block_k, warps in ((1, 1024, 4), (2, 1024, 4), (2, 512, 4), (4, 512, 4), (2, 1024, 2)):
            launch = lambda: int4_gemv(x1, qweight, scales, zeros, 128, None, block_n, block_k, warps)  # noqa: E731
            row[f"gemv_bn{block_n}_bk{block_k}_w{warps}"] = round(time_us(launch), 1)
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        row["bf16_m16_us"] = round(time_us(lambda: torch.nn.functional.linear(x16, bf16)), 1)
        for blocks in ((16, 32, 128), (16, 64, 128), (16, 16, 128), (16, 32, 64)):
            row[f"gemm_m16_{blocks[1]}x{blocks[2]}"] = round(time_us(lambda: int4_gemm(x16, qweight, scales, zeros, 128, None, blocks)), 1)
        results[name] = row
        print(f"  {name}: {row}", file=sys.stderr, flush=True)
        del bf16
        torch.cuda.empty_cache()
    return results


def use_choices(chosen: list[dict]) -> None:
    """Route each (rows bucket, N, K) of ``chosen`` to its kernel and launch."""
    from sonar_cuda.kernels import int4_gemm
    from sonar_cuda.kernels.int4_unit import Int4Launch

    for row in chosen:
        launch = Int4Launch(**row["launch"]) if row["launch"] else None
        int4_gemm.CHOICES[(row["bucket"], row["n"], row["k"])] = int4_gemm.Int4Choice(row["kernel"], launch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time each kernel launch per shape and block choice")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--choices", type=Path, default=None, help="int4_sweep.py's fastest kernel per shape, measured as int4_chosen")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    summary: dict[str, object] = {"model": "Llama-3.1-8B (dummy weights)", "gptq": GPTQ_CONFIG}
    if args.sweep:
        summary["kernels_us"] = sweep()
    if not args.skip_engines:
        root = Path(tempfile.mkdtemp(prefix="sonar-int4-"))
        engines = [("int4", True), ("bf16", False)] + ([("int4_chosen", True)] if args.choices else [])
        for label, quantized in engines:
            if label == "int4_chosen":
                use_choices(json.loads(args.choices.read_text()))
            summary[label] = measure_engine(write_config(root, quantized))
            print(f"  {label}: {summary[label]}", file=sys.stderr, flush=True)
            if args.output_json:
                Path(args.output_json).write_text(json.dumps(summary, indent=1))
        bf16 = summary["bf16"]
        summary["acceptance"] = {
            label: {
                "tpot_le_1.6ms": summary[label]["tpot_ms"] <= 1.6,
                "batch16_not_slower_than_bf16": summary[label]["batch16_tok_s"] >= bf16["batch16_tok_s"],
            }
            for label, quantized in engines if quantized
        }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
