"""The FP8 KV cache against the model-dtype (bf16) cache on Llama-3.1-8B random weights, in one run.

For each ``kv_cache_dtype`` (auto, fp8) one engine is built as the benchmark suite builds it
(``load_format="dummy"``, the same ``gpu_memory_utilization``), and the run reports:

- the KV blocks the same memory holds (the profiled budget over the bytes of a block;
  acceptance: fp8 twice auto);
- workload c (500 requests, 128 prompt / 2,048 output tokens, the suite's prompts and warm-up;
  ``--scale`` runs a fraction of the requests): output tok/s (acceptance: fp8 no slower).

``--fp8-launch BLOCK_N:WARPS:STAGES,...`` also measures workload c with the FP8 cache under
each other decode-attention launch shape (one engine each, after the engine's own choice), so a
candidate is judged beside the choice in the same run.

Prints one JSON summary line at the end.

    python sonar-cuda/benchmarks/kv_fp8.py [--scale 1.0] [--gpu-memory-utilization 0.88] [--fp8-launch 32:1:5] [--output-json F]
    # FP8 W8A8 weights, the FP8 cache alone, at the engine's launch and another
    python sonar-cuda/benchmarks/kv_fp8.py --quantization fp8 --kv-dtypes fp8 --fp8-launch 32:1:5
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from sonar.cli.bench_suite import SPECS, Row, _engine, _release, _run_engine_rows, _write_config

decode_attention = importlib.import_module("sonar_cuda.kernels.decode_attention")  # the module (the package exports the function)

MODEL = "Llama-3.1-8B"
DTYPES = ("auto", "fp8")


def measure(folder: Path, kv_cache_dtype: str, utilization: float, scale: float, quantization: str | None = None) -> dict[str, float]:
    """KV blocks and workload c's output tok/s of one engine."""
    spec = next(s for s in SPECS if s.key == "c" and s.model == MODEL)
    options = {"quantization": quantization} if quantization else {}
    llm = _engine(folder, MODEL, utilization, spec.max_num_seqs, kv_cache_dtype=kv_cache_dtype, **options)
    engine = llm.llm_engine
    runner = engine.core.executor.worker.model_runner
    profile = engine.memory_profile()
    budget = profile.get("kv_cache_budget_bytes", profile["kv_cache_bytes"])
    result: dict[str, float] = {
        # what the memory budget holds; the engine allocates at most max_num_seqs full-length
        # sequences of it (kv_cache_blocks)
        "budget_blocks": budget // runner.kv_bytes_per_block(),
        "kv_cache_budget_gib": round(budget / 2**30, 2),
        "kv_cache_blocks": engine.core.cache_config.num_blocks,
        "kv_bytes_per_block": runner.kv_bytes_per_block(),
    }
    row = Row(spec.key, MODEL, spec.what, spec.unit, spec.target, spec.floor)
    _run_engine_rows(llm, MODEL, [spec], scale, {(spec.key, MODEL): row})
    result["c_tok_s"] = round(row.value, 1)
    result["c_requests"] = row.detail["requests"]
    result["c_elapsed_s"] = row.detail["elapsed_s"]
    del llm, engine, runner
    _release()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of workload c's 500 requests")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    parser.add_argument("--fp8-launch", default="", help="BLOCK_N:WARPS:STAGES,... other FP8 decode-attention launches to measure")
    parser.add_argument("--quantization", default=None, help="the weights' quantization for every engine (e.g. fp8: W8A8)")
    parser.add_argument("--kv-dtypes", default=",".join(DTYPES), help="which caches to measure at the engine's own launch (auto, fp8)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--kv-dtypes takes a comma-separated subset of {', '.join(DTYPES)}")
    launches = [tuple(int(part) for part in item.split(":")) for item in args.fp8_launch.split(",") if item]
    if any(len(launch) != 3 for launch in launches):
        parser.error("--fp8-launch takes BLOCK_N:WARPS:STAGES items")
    with tempfile.TemporaryDirectory() as root:
        folder = _write_config(Path(root), MODEL)
        results = {dtype: measure(folder, dtype, args.gpu_memory_utilization, args.scale, args.quantization) for dtype in dtypes}
        chosen = (decode_attention.FP8_BLOCK_N, decode_attention.FP8_NUM_WARPS, decode_attention.FP8_NUM_STAGES)
        for block_n, warps, stages in launches:
            decode_attention.FP8_BLOCK_N, decode_attention.FP8_NUM_WARPS, decode_attention.FP8_NUM_STAGES = block_n, warps, stages
            try:
                results[f"fp8_{block_n}x{warps}x{stages}"] = measure(folder, "fp8", args.gpu_memory_utilization, args.scale, args.quantization)
            finally:
                decode_attention.FP8_BLOCK_N, decode_attention.FP8_NUM_WARPS, decode_attention.FP8_NUM_STAGES = chosen
    summary: dict[str, object] = {
        "model": MODEL,
        "quantization": args.quantization,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "scale": args.scale,
        **{f"{dtype}_{key}": value for dtype, result in results.items() for key, value in result.items()},
    }
    if "auto" in results and "fp8" in results:
        auto, fp8 = results["auto"], results["fp8"]
        summary["blocks_ratio"] = round(fp8["budget_blocks"] / auto["budget_blocks"], 3)
        summary["c_ratio"] = round(fp8["c_tok_s"] / auto["c_tok_s"], 3)
        summary.update({f"c_ratio_{name}": round(result["c_tok_s"] / auto["c_tok_s"], 3) for name, result in results.items() if name not in DTYPES})
        summary["twice_the_blocks"] = summary["blocks_ratio"] >= 1.99
        summary["c_no_slower"] = summary["c_ratio"] >= 0.98  # within run-to-run noise
    line = json.dumps(summary)
    print(line, flush=True)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    if "c_ratio" in summary:
        print(f"blocks x{summary['blocks_ratio']}, workload c x{summary['c_ratio']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
