"""Time CpuAttentionBackend over a whole step at SmolLM2-135M's shape (not a test).

    python sonar-cpu/benchmarks/bench_attention.py [--batch 64] [--context 300] [--layers 30] [--threads N]

Prints the attention time of a decode step (all layers, metadata included) next to the time of
the same step's linear layers, so the fraction attention takes of a step is visible; then a
prefill step of a few prompts. Minimums are the numbers to compare on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cpu_paged_step import make_step  # noqa: E402
from sonar_cpu import attention_plan  # noqa: E402
from sonar_cpu.attention import CpuAttentionBackend  # noqa: E402

SPLIT = (attention_plan.BUCKET_CALL_COST_TOKENS, attention_plan.MAX_GATHER_BYTES)
ONE_CALL = (10**12, 10**15)  # all decodes in one padded call, for comparison

# SmolLM2-135M
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def time_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples), statistics.median(samples)


def attention_step(
    context_lens: list[int], layers: int, dtype: torch.dtype, split: tuple[int, int], query_lens: list[int] | None = None
) -> Callable[[], object]:
    query_lens = query_lens or [1] * len(context_lens)
    step = make_step(context_lens, query_lens, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     head_dim=HEAD_DIM, block_size=16, dtype=dtype)
    caches = [step.kv_cache.clone() for _ in range(layers)]
    backend = CpuAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)

    def run() -> None:
        CpuAttentionBackend.bucket_call_cost_tokens, attention_plan.MAX_GATHER_BYTES = split
        CpuAttentionBackend.prepare_metadata(step.metadata)
        for cache in caches:
            backend.forward(step.query, step.key, step.value, cache, step.metadata)

    return run


def linear_step(batch: int, layers: int, dtype: torch.dtype) -> Callable[[], object]:
    x = torch.randn(batch, HIDDEN, dtype=dtype)
    qkv = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, dtype=dtype)
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM, dtype=dtype)
    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=dtype)
    down = torch.randn(HIDDEN, INTERMEDIATE, dtype=dtype)

    def run() -> None:
        for _ in range(layers):
            x @ qkv.T
            x @ o.T
            (x @ gate_up.T)[:, :INTERMEDIATE] @ down.T

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    generator = torch.Generator().manual_seed(0)
    uniform = [args.context] * args.batch
    mixed = torch.randint(20, 800, (args.batch,), generator=generator).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        lin_min, lin_med = time_ms(linear_step(args.batch, args.layers, dtype), args.repeats)
        print(f"{str(dtype):15} linear layers B={args.batch}: min {lin_min:7.1f} ms  median {lin_med:7.1f} ms")
        cases = [(f"ctx {args.context}", uniform, SPLIT),
                 (f"ctx {args.context}, one call", uniform, ONE_CALL),
                 ("ctx 20..800", mixed, SPLIT),
                 ("ctx 20..800, one call", mixed, ONE_CALL)]
        for label, lens, split in cases:
            att_min, att_med = time_ms(attention_step(lens, args.layers, dtype, split), args.repeats)
            print(f"{str(dtype):15} attention {label:24}: min {att_min:7.1f} ms  median {att_med:7.1f} ms"
                  f"  ({att_min / args.layers:.2f} ms/layer at best)")
        # prefill: 4 fresh prompts of 256 tokens, and 4 chunks of 256 over 512 cached tokens
        for label, context_lens in (("prefill 4x256", [0] * 4), ("prefill 4x256 after 512", [512] * 4)):
            step_fn = attention_step(context_lens, args.layers, dtype, SPLIT, [256] * 4)
            att_min, att_med = time_ms(step_fn, max(3, args.repeats // 3))
            print(f"{str(dtype):15} attention {label:24}: min {att_min:7.1f} ms  median {att_med:7.1f} ms")


if __name__ == "__main__":
    main()
