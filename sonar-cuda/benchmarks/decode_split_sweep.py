"""Paged decode attention at mid batch sizes: split-KV factor and pipeline stages against the
engine's choice (Llama-3.1-8B's 32 query / 8 KV heads, head_dim 128, bf16, in a CUDA graph).

    python sonar-cuda/benchmarks/decode_split_sweep.py --batches 16,32,64 --contexts 512,768,1024
"""

from __future__ import annotations

import argparse
import json

import torch

from sonar_cuda.graph_timing import graph_us
from sonar_cuda.kernels.decode_attention import _num_sms, choose_num_splits, decode_attention

PAGE = 16
HEADS, KV_HEADS, DIM = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,32,64")
    parser.add_argument("--contexts", default="512,768,1024")
    parser.add_argument("--max-model-len", type=int, default=2304)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            blocks_per_seq = -(-context // PAGE)
            layers = 8  # distinct caches, so each call reads cold memory
            caches = [(torch.randn(batch * blocks_per_seq, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
                       torch.randn(batch * blocks_per_seq, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
            tables = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, blocks_per_seq)
            seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            query = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(query)
            engine_splits = choose_num_splits(batch, KV_HEADS, args.max_model_len, _num_sms(query.device))
            entry = {"engine_splits": engine_splits}
            kv_bytes = batch * context * KV_HEADS * DIM * 2 * 2
            for splits in (1, 2, 3, 4, 6, 8):
                for stages in (2, 3):
                    us = graph_us([lambda k=k, v=v: decode_attention(query, k, v, tables, seq_lens, 0.088, out=out, num_splits=splits, num_stages=stages)
                                   for k, v in caches])
                    entry[f"splits{splits} stages{stages}"] = [us, round(kv_bytes / us / 1e6, 2)]
            results[f"b{batch} ctx{context}"] = entry
            print(batch, context, json.dumps(entry), flush=True)
            del caches
            torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
