"""The embedded GGUF (SmolLM2-135M-Instruct, Q4_1/Q8_0) on the CPU: Sonar natively quantized,
Sonar dequantized to float32, llama.cpp (llama-cpp-python) and transformers' batched generate().

Measures batch-1 decode tok/s (steady state: the time of N+1 tokens minus that of 1) and a mixed
workload of 24 requests (inputs 16-192, outputs 16-96 tokens; llama.cpp serves them one after
another, transformers in one padded batch). Prints one JSON line, with the host's 1-minute load
average before and after (the figures are only comparable at a low load).

    SONAR_PLATFORM=cpu SONAR_CPU_THREADS=2 python sonar-cpu/benchmarks/bench_gguf_native.py

``--moe q8_0|q4_0`` runs the same on a Qwen3-MoE-shaped model with random weights instead
(``MOE_SHAPE``: 64 experts, 8 chosen, in 8 layers; written by Sonar's GGUF writer as llama.cpp
lays the file out, with SmolLM2's tokenizer): a mixture-of-experts layer's experts kept in
their blocks, against llama.cpp on the same file.

``--k-quant q4_k_m|q5_k_m|q2_k|q3_k|q4_k|q5_k|q6_k`` runs it on a Llama-shaped model with random weights
(``K_QUANT_SHAPE``: about 280M parameters, widths multiples of 256) in K-quant super-blocks, the
``_m`` names in llama.cpp's mixed recipes (Q6_K for the head and some value and down
projections); ``--k-quant smollm2-q4_k_m`` on the embedded model's own weights written again in
Q4_K_M (its 576-wide inputs fall back to Q5_0, as llama.cpp writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

DECODE_TOKENS = 128
#: a Qwen3-MoE layer scaled down: about 520M parameters, 120M of them read per token
MOE_SHAPE = dict(
    hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=8, intermediate_size=2048,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, mlp_only_layers=[], initializer_range=0.02,
)


#: a Llama layer whose widths K-quants take (multiples of 256): about 280M parameters
K_QUANT_SHAPE = dict(
    hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=16, intermediate_size=2816,
    initializer_range=0.02, tie_word_embeddings=False,
)


def write_k_quant_gguf(folder: str, kind: str) -> str:
    """A Llama-shaped GGUF (``K_QUANT_SHAPE``, random weights) in ``kind`` under ``folder``, or
    for ``smollm2-q4_k_m`` the embedded model in Q4_K_M."""
    from pathlib import Path

    from sonar_models.formats.gguf_blocks import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
    from sonar_models.formats.gguf_quantize import write_gguf
    from sonar_models.testing import build_tiny_model, rewrite_gguf, smollm2_gguf_path

    if kind == "smollm2-q4_k_m":
        return str(rewrite_gguf(smollm2_gguf_path(), folder, "Q4_K_M"))

    hf = build_tiny_model("llama", Path(folder) / "hf", **K_QUANT_SHAPE)
    path = Path(folder) / f"llama-{kind}.gguf"
    recipe = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q2_k": Q2_K, "q3_k": Q3_K, "q4_k": Q4_K, "q5_k": Q5_K, "q6_k": Q6_K}[kind]
    write_gguf(hf, path, recipe, tokenizer_from=smollm2_gguf_path())
    return str(path)


def write_moe_gguf(folder: str, kind: str) -> str:
    """A Qwen3-MoE-shaped GGUF (``MOE_SHAPE``, random weights) in ``kind`` blocks under ``folder``."""
    from pathlib import Path

    from sonar_models.formats.gguf_blocks import Q4_0, Q8_0
    from sonar_models.formats.gguf_quantize import write_gguf
    from sonar_models.testing import build_tiny_model, smollm2_gguf_path

    hf = build_tiny_model("qwen3_moe", Path(folder) / "hf", **MOE_SHAPE)
    path = Path(folder) / f"moe-{kind}.gguf"
    write_gguf(hf, path, {"q8_0": Q8_0, "q4_0": Q4_0}[kind], tokenizer_from=smollm2_gguf_path())
    return str(path)


def workload(seed: int = 0, count: int = 24) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randint(100, 49000) for _ in range(rng.randint(16, 192))], rng.randint(16, 96)) for _ in range(count)]


def sonar_runs(path: str, quantization: str | None, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    from sonar import LLM, SamplingParams

    llm = LLM(path, quantization=quantization, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    prompt = [{"prompt_token_ids": requests[0][0][:16]}]

    def run(n: int) -> float:
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - started

    run(8)  # warm up
    decode = DECODE_TOKENS / (run(DECODE_TOKENS + 1) - run(1))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"decode_tok_s": round(decode, 1), "mixed_tok_s": round(produced / elapsed, 1)}


def llama_cpp_runs(path: str, threads: int, requests: list[tuple[list[int], int]], plain_buffers: bool) -> dict[str, float]:
    import llama_cpp
    from llama_cpp import Llama

    if plain_buffers:  # weights in plain CPU buffers: no AMX or repacked copies
        defaults = llama_cpp.llama_model_default_params

        def plain_params():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = plain_params
        llama_cpp.llama.llama_cpp.llama_model_default_params = plain_params
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

    def run(prompt: list[int], n: int) -> float:
        llm.reset()
        started = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - started

    prompt = requests[0][0][:16]
    run(prompt, 8)
    decode = DECODE_TOKENS / (run(prompt, DECODE_TOKENS + 1) - run(prompt, 1))
    started = time.perf_counter()
    for p, n in requests:
        run(p, n)
    elapsed = time.perf_counter() - started
    return {"decode_tok_s": round(decode, 1), "mixed_tok_s": round(sum(n for _, n in requests) / elapsed, 1)}


def transformers_runs(path: str, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    import torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM

    gguf = Path(path)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    width = max(len(p) for p, _ in requests)
    ids = torch.full((len(requests), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, _) in enumerate(requests):  # left padding
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(n for _, n in requests), do_sample=False, min_new_tokens=1, pad_token_id=2)
    elapsed = time.perf_counter() - started
    return {"mixed_tok_s": round(sum(n for _, n in requests) / elapsed, 1)}  # requested tokens only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", nargs="*", default=[], choices=["native", "dequantized", "llama.cpp", "transformers"])
    parser.add_argument(
        "--llama-cpp-plain-buffers", action="store_true",
        help="load llama.cpp's weights without its extra buffer types (AMX, repacking): on hosts that report AMX "
        "but fault in it, as llama-cpp-python 0.3.36 does on some virtual machines",
    )
    parser.add_argument("--moe", choices=["q8_0", "q4_0"], help="a Qwen3-MoE-shaped model with random weights in these blocks instead")
    parser.add_argument(
        "--k-quant", choices=["q4_k_m", "q5_k_m", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "smollm2-q4_k_m"],
        help="a Llama-shaped model with random weights in these K-quant blocks (or llama.cpp's mixed recipe) instead",
    )
    args = parser.parse_args()
    import tempfile

    from sonar_models.testing import smollm2_gguf_path

    threads = int(os.environ.get("SONAR_CPU_THREADS", "2"))
    if args.moe:
        path = write_moe_gguf(tempfile.mkdtemp(), args.moe)
    elif args.k_quant:
        path = write_k_quant_gguf(tempfile.mkdtemp(), args.k_quant)
    else:
        path = str(smollm2_gguf_path())
    requests = workload()
    load_before = os.getloadavg()[0]  # the host's 1-minute load: other work on the same cores
    results: dict[str, dict[str, float]] = {}
    if "native" not in args.skip:
        results["sonar_native"] = sonar_runs(path, None, requests)
    if "dequantized" not in args.skip:
        results["sonar_dequantized"] = sonar_runs(path, "unquantized", requests)
    if "llama.cpp" not in args.skip:
        results["llama_cpp"] = llama_cpp_runs(path, threads, requests, args.llama_cpp_plain_buffers)
    if "transformers" not in args.skip:
        import torch

        torch.set_num_threads(threads)
        results["transformers_batched"] = transformers_runs(path, requests)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    ratios = {}
    if "sonar_native" in results and "llama_cpp" in results:
        ratios["decode_vs_llama_cpp"] = round(results["sonar_native"]["decode_tok_s"] / results["llama_cpp"]["decode_tok_s"], 2)
        ratios["mixed_vs_llama_cpp"] = round(results["sonar_native"]["mixed_tok_s"] / results["llama_cpp"]["mixed_tok_s"], 2)
    if "sonar_native" in results and "transformers_batched" in results:
        ratios["mixed_vs_transformers"] = round(
            results["sonar_native"]["mixed_tok_s"] / results["transformers_batched"]["mixed_tok_s"], 2
        )
    if args.moe:
        model = f"qwen3-moe-shaped {args.moe}"
    elif args.k_quant:
        model = "SmolLM2-135M-Instruct, written again in Q4_K_M" if args.k_quant == "smollm2-q4_k_m" else f"llama-shaped {args.k_quant}"
    else:
        model = "SmolLM2-135M-Instruct"
    print(json.dumps({"model": model, "threads": threads, "requests": len(requests), "load_average_before_after": load, **results, **ratios}))


if __name__ == "__main__":
    main()
