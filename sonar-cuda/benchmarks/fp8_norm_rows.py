"""FP8 rows from the norm, measured: Llama-3.1-8B dummy weights with FP8 W8A8 and the FP8 KV cache
(workload c's engine), decode steps profiled with the norms emitting FP8 rows for the q/k/v and
gate/up projections, without (the products quantize their inputs themselves), and with again
(``--engines``; ``norm_rows_from_one`` also at one token, where the products take the prepared
GEMV), one engine each in one run: wall and GPU-busy time per step and the top kernels, at batch 256 with
1,024-token contexts and at batch 1.

    python sonar-cuda/benchmarks/fp8_norm_rows.py --output-json norm_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import sonar_cuda.ops as cuda_ops
from sonar import ops
from sonar.cli.bench_suite import (
    SPECS,
    _engine,
    _profile_decode,
    _release,
    _write_config,
)

MODEL = "Llama-3.1-8B"
FUSED = ("rms_norm_fp8_rows", "fused_add_rms_norm_fp8_rows")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024, help="context tokens of the batch-256 steps")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--engines", default="norm_rows,no_norm_rows,norm_rows_again", help="engines in order, of norm_rows, no_norm_rows, norm_rows_again, norm_rows_from_one")
    args = parser.parse_args()
    default_min_tokens = cuda_ops.FP8_ROWS_MIN_TOKENS
    kernels = {name: cuda_ops.OPS[name] for name in FUSED}
    spec = next(s for s in SPECS if s.key == "c" and s.model == MODEL)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        folder = _write_config(Path(root), MODEL)
        for label in args.engines.split(","):
            ops.unregister_ops("cuda")  # the engine's worker registers the platform's kernels as they are now
            # from_one: the norm's rows at one token too, where the product is the prepared GEMV
            cuda_ops.FP8_ROWS_MIN_TOKENS = 1 if label.endswith("from_one") else default_min_tokens
            for name in FUSED:
                if label == "no_norm_rows":
                    cuda_ops.OPS.pop(name, None)
                else:
                    cuda_ops.OPS[name] = kernels[name]
            llm = _engine(folder, MODEL, 0.88, spec.max_num_seqs, quantization="fp8", kv_cache_dtype="fp8")
            results[label] = {
                "batch_256": _profile_decode(llm, MODEL, batch=256, steps=8, prompt_len=args.context),
                "batch_1": _profile_decode(llm, MODEL, batch=1, steps=32, prompt_len=128),
            }
            print(label, json.dumps(results[label]), flush=True)
            del llm
            _release()
    line = json.dumps(results)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    for label, result in results.items():
        print(f"{label}: batch 256 {result['batch_256']['wall_ms_per_step']} ms a step, batch 1 {result['batch_1']['wall_ms_per_step']} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
