"""Does ``gpu_memory_utilization`` bound the process? Llama-3.1-8B (random bf16 weights) with
``--gpu-memory-utilization 0.95 --max-num-seqs 1024``: a decode batch of 1,024 requests with
``logprobs=20``, next to prompts of the maximum length with ``prompt_logprobs=20``; prints the
profiled peak, the KV cache sized, and the device memory the process reached.

    python sonar-cuda/benchmarks/memory_bound.py [--max-model-len 8192] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from sonar import LLM, SamplingParams
from sonar.cli.bench_suite import MODELS


def device_used_bytes() -> int:
    """What the driver reports in use on the device (every allocation of every process)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-short", type=int, default=1024)
    parser.add_argument("--num-long", type=int, default=16)
    parser.add_argument("--utilization", type=float, default=0.95)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="sonar-memory-"))
    (root / "config.json").write_text(json.dumps(MODELS["Llama-3.1-8B"]))
    started = time.perf_counter()
    llm = LLM(
        str(root), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
        gpu_memory_utilization=args.utilization, max_num_seqs=1024, enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - started
    engine = llm.llm_engine
    total = torch.cuda.mem_get_info()[1]
    profile = engine.memory_profile()
    torch.cuda.reset_peak_memory_stats()
    vocab = MODELS["Llama-3.1-8B"]["vocab_size"]
    generator = torch.Generator().manual_seed(0)

    def prompt(length: int) -> dict:
        return {"prompt_token_ids": torch.randint(0, vocab, (length,), generator=generator).tolist()}

    out_len = 32
    prompts = [prompt(64) for _ in range(args.num_short)] + [prompt(args.max_model_len - out_len) for _ in range(args.num_long)]
    short = SamplingParams(max_tokens=out_len, temperature=0.8, top_p=0.95, top_k=100, repetition_penalty=1.05, logprobs=20, ignore_eos=True)
    long = SamplingParams(max_tokens=out_len, temperature=0.0, logprobs=20, prompt_logprobs=20, ignore_eos=True)
    peak_used = device_used_bytes()
    started = time.perf_counter()
    outputs = llm.generate(prompts, [short] * args.num_short + [long] * args.num_long)
    run_s = time.perf_counter() - started
    peak_used = max(peak_used, device_used_bytes())  # the allocator keeps what it reserved: this is the peak
    nvidia_smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "total_bytes": total,
        "bound_bytes": int(args.utilization * total),
        "profile": profile,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "device_used_bytes_after": peak_used,
        "nvidia_smi_used_total_mib": nvidia_smi,
        "within_bound": peak_used <= args.utilization * total,
        "requests": len(outputs),
        "all_finished": all(len(o.outputs[0].token_ids) == out_len for o in outputs),
        "prompt_logprobs_rows": [len(o.prompt_logprobs or []) for o in outputs[args.num_short:]][:3],
        "preemptions": engine.get_stats().num_preemptions,
        "load_s": round(load_s, 1),
        "run_s": round(run_s, 1),
    }
    gib = {k: round(v / 2**30, 2) for k, v in result.items() if k.endswith("_bytes") and isinstance(v, int)}
    print(json.dumps(result | {"GiB": gib, "profile_GiB": {k: round(v / 2**30, 2) for k, v in profile.items() if k.endswith("bytes")}}, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return 0 if result["within_bound"] and result["all_finished"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
