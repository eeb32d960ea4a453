"""LoRA serving through the engine against the base model, in one run:

    python sonar-cuda/benchmarks/lora_serving.py --out results/lora     # H200, Llama-3.1-8B dummy

One engine (``enable_lora``, ``max_loras`` = the number of adapters) serves ``sonar bench
suite``'s Llama-3.1-8B with random weights (``load_format=dummy``) and ``--adapters`` random
rank-``--rank`` adapters written in PEFT's layout (``adapter_config.json``,
``adapter_model.safetensors``) on q/k/v/o and gate/up/down of every layer. Measured, each after
a warm-up:

1. a batch of ``--batch`` requests (``--prompt-len`` in, ``--output-len`` out, ``ignore_eos``)
   with no adapter, and the same batch with the adapters mixed round-robin: output tok/s of
   each and their ratio;
2. batch-1 TPOT (the time of ``--tpot-tokens`` more output tokens, per token) without and
   with an adapter, and their ratio.

"Without an adapter" runs in the same LoRA-enabled engine: a step with no adapter request
runs no LoRA work (the decode graphs without the LoRA path), as an engine without LoRA would.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sonar-server" / "benchmarks"))
from serve_vs_offline import write_dummy_model  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A random rank-``rank`` LoRA adapter for every linear layer of a Llama ``config``."""
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": "Llama-3.1-8B",
    }))
    return folder


def timed(llm, prompts, params, lora_requests) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora_requests)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-name", default="Llama-3.1-8B")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--tpot-tokens", type=int, default=256)
    parser.add_argument("--fused-tokens", type=int, default=None,
                        help="up to this many tokens a LoRA layer runs the fused shrink+expand launch (default: the kernel module's)")
    parser.add_argument("--overlap-tokens", type=int, default=None,
                        help="up to this many tokens a LoRA layer's shrink runs on a side stream beside the base product "
                             "(default: the kernel module's; 0: after the product)")
    parser.add_argument("--out", default="lora-serving-results")
    args = parser.parse_args()

    from sonar import LLM, SamplingParams
    from sonar.lora import LoRARequest
    from sonar_cuda.kernels import lora as lora_kernels

    if args.fused_tokens is not None:  # the engine runs in this process: its layers read this
        lora_kernels.FUSED_TOKENS = args.fused_tokens
    if args.overlap_tokens is not None:
        lora_kernels.OVERLAP_TOKENS = args.overlap_tokens

    root = Path(tempfile.mkdtemp(prefix="sonar-lora-bench-"))
    model = write_dummy_model(root, args.model_name)
    config = json.loads((model / "config.json").read_text())
    started = time.perf_counter()
    adapters = [
        LoRARequest(f"adapter{i}", i + 1, str(write_adapter(root / f"adapter{i}", config, args.rank, seed=i)))
        for i in range(args.adapters)
    ]
    print(f"wrote {args.adapters} adapters in {time.perf_counter() - started:.1f} s", flush=True)
    llm = LLM(str(model), load_format="dummy", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_model_len=args.prompt_len + args.output_len + args.tpot_tokens + 8, gpu_memory_utilization=0.85)
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(args.prompt_len)]} for _ in range(args.batch)]
    batch_params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
    results: dict = {"model": args.model_name, "adapters": args.adapters, "rank": args.rank, "batch": args.batch,
                     "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "device": torch.cuda.get_device_name(), "fused_tokens": lora_kernels.FUSED_TOKENS,
                     "overlap_tokens": lora_kernels.OVERLAP_TOKENS}

    small = [{"prompt_token_ids": p["prompt_token_ids"][:32]} for p in prompts[: min(8, args.batch)]]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(small, warm)  # warm-up: graphs, kernels, every adapter into its slot
    llm.generate(small, warm, lora_request=mixed[: len(small)])
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), lora_request=mixed)

    base_s = timed(llm, prompts, batch_params, None)
    lora_s = timed(llm, prompts, batch_params, mixed)
    tokens = args.batch * args.output_len
    results["base_output_tok_s"] = round(tokens / base_s, 1)
    results["lora_output_tok_s"] = round(tokens / lora_s, 1)
    results["throughput_ratio"] = round(base_s / lora_s, 3)
    print(json.dumps({k: results[k] for k in ("base_output_tok_s", "lora_output_tok_s", "throughput_ratio")}), flush=True)

    one = [prompts[0]]
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=1 + args.tpot_tokens, ignore_eos=True)
    tpot = {}
    for label, request in (("base", None), ("lora", [adapters[0]])):
        timed(llm, one, long, request)  # warm-up
        runs = [(timed(llm, one, long, request) - timed(llm, one, short, request)) / args.tpot_tokens for _ in range(3)]
        tpot[label] = sorted(runs)[1]
    results["batch1_tpot_base_ms"] = round(1000 * tpot["base"], 3)
    results["batch1_tpot_lora_ms"] = round(1000 * tpot["lora"], 3)
    results["tpot_ratio"] = round(tpot["lora"] / tpot["base"], 3)
    print(json.dumps(results, indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
