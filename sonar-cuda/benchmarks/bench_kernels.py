"""Micro-benchmarks of the attention kernels on one GPU, against the device's copy bandwidth.

    python sonar-cuda/benchmarks/bench_kernels.py [--json results.json] [--sweep]

Decode attention is memory-bound: its figure of merit is the bytes it must read (every cached
key and value once, plus queries, outputs and block tables) over its time, against a
device-to-device copy's bandwidth (bytes read + written). Prefill attention is reported in
TFLOP/s, beside torch's scaled_dot_product_attention on the same (unpaged) tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing

from sonar_cuda.kernels.decode_attention import decode_attention
from sonar_cuda.kernels.prefill_attention import prefill_attention


@dataclass(slots=True)
class DecodeResult:
    name: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    config: str
    time_us: float
    gbps: float
    fraction_of_copy: float


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 4 GiB, counting bytes read and written."""
    src = torch.empty(2**31, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    del src, dst
    return 2 * 2**32 / (ms * 1e-3) / 1e9


def paged_cache(batch: int, context: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype):
    pages_per_seq = math.ceil(context / page_size)
    num_blocks = batch * pages_per_seq
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    # shuffled pages, as after many requests came and went
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, block_tables, seq_lens


def bench_decode(
    name: str, batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, copy_gbps: float,
    page_size: int = 16, dtype: torch.dtype = torch.bfloat16, **config: int,
) -> DecodeResult:
    k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, context, num_kv_heads, head_dim, page_size, dtype)
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def run() -> None:
        decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, out=out, max_seq_len=context, **config)

    run()
    ms = triton.testing.do_bench_cudagraph(run, rep=200)
    itemsize = k_cache.element_size()
    moved = (
        2 * batch * context * num_kv_heads * head_dim * itemsize  # keys and values
        + 2 * query.numel() * itemsize  # queries and outputs
        + block_tables.numel() * 4
    )
    gbps = moved / (ms * 1e-3) / 1e9
    label = ",".join(f"{k}={v}" for k, v in config.items()) or "default"
    return DecodeResult(name, batch, context, num_heads, num_kv_heads, head_dim, label, ms * 1e3, gbps, gbps / copy_gbps)


def bench_prefill(
    name: str, num_seqs: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, **config: int
) -> dict:
    dtype, page_size = torch.bfloat16, 16
    k_cache, v_cache, block_tables, seq_lens = paged_cache(num_seqs, seq_len, num_kv_heads, head_dim, page_size, dtype)
    query = torch.randn(num_seqs * seq_len, num_heads, head_dim, dtype=dtype, device="cuda")
    starts = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = head_dim**-0.5
    ms = triton.testing.do_bench(
        lambda: prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, starts, seq_len, scale, out=out, **config),
        rep=200,
    )
    # causal: half of the full score matrix, two matrix products of 2*d flops per entry
    flops = num_seqs * num_heads * seq_len * seq_len / 2 * 4 * head_dim
    q = query.view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)
    k = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), rep=200)
    return {
        "name": name, "num_seqs": num_seqs, "seq_len": seq_len, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "config": ",".join(f"{k}={v}" for k, v in config.items()) or "default",
        "time_us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
        "torch_sdpa_time_us": sdpa_ms * 1e3, "torch_sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
    }


def print_decode(results: list[DecodeResult]) -> None:
    print(f"{'decode shape':<14}{'batch':>6}{'ctx':>7}{'heads':>7}  {'config':<40}{'us':>9}{'GB/s':>8}{'of copy':>9}")
    for r in results:
        heads = f"{r.num_heads}/{r.num_kv_heads}"
        print(f"{r.name:<14}{r.batch:>6}{r.context:>7}{heads:>7}  {r.config:<40}{r.time_us:>9.1f}{r.gbps:>8.0f}{r.fraction_of_copy:>9.1%}")


def print_prefill(results: list[dict]) -> None:
    for r in results:
        print(
            f"prefill {r['name']:<13} {r['num_seqs']}x{r['seq_len']:<5} {r['config']:<44} {r['time_us']:>8.1f} us"
            f" {r['tflops']:>6.1f} TFLOP/s   (torch sdpa, unpaged: {r['torch_sdpa_tflops']:.1f} TFLOP/s)"
        )


def run_isolated(kind: str, config: dict[str, int]) -> dict | None:
    """One sweep point in its own process, so a config that faults cannot poison the others."""
    spec = ",".join(f"{k}={v}" for k, v in config.items())
    result = subprocess.run(
        [sys.executable, __file__, "--one", kind, spec], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        print(f"{kind} {spec}: FAILED: {(result.stderr.strip().splitlines() or ['?'])[-1][:160]}")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def one(kind: str, spec: str, copy_gbps: float) -> dict:
    config = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
    if kind == "decode":
        return asdict(bench_decode("qwen3-0.6b", 256, 1024, 16, 8, 128, copy_gbps, **config))
    if kind == "decode1":
        return asdict(bench_decode("llama-3.1-8b", 1, 32768, 32, 8, 128, copy_gbps, **config))
    if kind == "decode1short":
        return asdict(bench_decode("qwen3-0.6b", 1, 1024, 16, 8, 128, copy_gbps, **config))
    return bench_prefill("llama-3.1-8b", 4, 2048, 32, 8, 128, **config)


SWEEPS: dict[str, list[dict[str, int]]] = {
    "decode": [
        {"block_n": n, "num_warps": w, "num_stages": s} for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)
    ],
    "decode1": [{"num_splits": k} for k in (8, 16, 32, 64, 128)],
    "decode1short": [{"num_splits": k} for k in (1, 2, 4, 8, 16)],
    "prefill": [
        {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
        for m, n in ((64, 64), (128, 64), (128, 32)) for w in (4, 8) for s in (2, 3)
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sweep", action="store_true", help="also try tile sizes, warps, stages and splits, each in its own process")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        print(json.dumps(one(*args.one, copy_gbps=float(os.environ.get("SONAR_BENCH_COPY_GBPS", "4270")))))
        return
    copy_gbps = copy_bandwidth_gbps()
    os.environ["SONAR_BENCH_COPY_GBPS"] = str(copy_gbps)
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbps:.0f} GB/s (read + write)")
    decode = [
        bench_decode("qwen3-0.6b", 256, 1024, 16, 8, 128, copy_gbps),
        bench_decode("qwen3-0.6b", 64, 1024, 16, 8, 128, copy_gbps),
        bench_decode("qwen3-0.6b", 1, 1024, 16, 8, 128, copy_gbps),
        bench_decode("llama-3.1-8b", 256, 1152, 32, 8, 128, copy_gbps),
        bench_decode("llama-3.1-8b", 500, 2176, 32, 8, 128, copy_gbps),
        bench_decode("llama-3.1-8b", 1, 32768, 32, 8, 128, copy_gbps),
        bench_decode("llama-3.1-8b", 8, 32768, 32, 8, 128, copy_gbps),
    ]
    print_decode(decode)
    prefill = [
        bench_prefill("qwen3-0.6b", 8, 1024, 16, 8, 128),
        bench_prefill("llama-3.1-8b", 4, 2048, 32, 8, 128),
        bench_prefill("llama-3.1-8b", 16, 512, 32, 8, 128),
    ]
    print_prefill(prefill)
    sweep: dict[str, list[dict]] = {}
    if args.sweep:
        for kind, configs in SWEEPS.items():
            sweep[kind] = [r for r in (run_isolated(kind, c) for c in configs) if r is not None]
            if kind == "prefill":
                print_prefill(sweep[kind])
            else:
                print_decode([DecodeResult(**r) for r in sweep[kind]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "decode": [asdict(r) for r in decode], "prefill": prefill, "sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main()
