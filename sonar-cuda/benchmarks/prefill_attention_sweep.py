"""Time the paged prefill attention kernel over tile configurations at one workload shape.

    python sonar-cuda/benchmarks/prefill_attention_sweep.py [--seqs 8 --len 1024 --heads 32 --kv-heads 8]

Prints, per (BLOCK_M, BLOCK_N, num_warps, num_stages), the time of one launch and the attention
FLOP rate (causal: half of the 4 * len^2 * head_dim per head), checked against the default
configuration's output.
"""

from __future__ import annotations

import argparse

import torch

from sonar_cuda.kernels.prefill_attention import prefill_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    seqs, length, d = args.seqs, args.len, args.head_dim
    blocks_per_seq = length // args.block_size
    num_blocks = seqs * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, args.block_size, args.kv_heads, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), length, device=device, dtype=torch.int32)
    qsl = torch.arange(0, (seqs + 1) * length, length, device=device, dtype=torch.int32)
    query = torch.randn(seqs * length, args.heads, d, device=device, dtype=dtype)
    scale = d**-0.5
    flops = seqs * args.heads * 4 * length * length * d / 2
    reference = prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, length, scale)
    configs = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2)]
    for bm, bn, warps, stages in configs:
        try:
            out = prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, length, scale, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            torch.cuda.synchronize()
            err = (out.float() - reference.float()).abs().max().item()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, qsl, length, scale, out=out, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 10
            print(f"BLOCK_M={bm:4} BLOCK_N={bn:4} warps={warps} stages={stages}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  max|diff|={err:.3g}", flush=True)
        except Exception as exc:  # a configuration that does not fit the shared memory
            print(f"BLOCK_M={bm:4} BLOCK_N={bn:4} warps={warps} stages={stages}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)


if __name__ == "__main__":
    main()
