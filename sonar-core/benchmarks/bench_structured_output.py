"""Cost per step of structured-output masking: fill the allowed-token bitmask of every
constrained row of a batch in one call, then apply it to the logits.

    python sonar-core/benchmarks/bench_structured_output.py --batch 64 [--device cuda] [--tokenizer DIR]

Each row follows its own JSON schema and advances one token per step (the token each grammar
allows that the random logits rank highest), so the masks change every step as in serving.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from sonar.structured_output.bitmask import GrammarBitmask
from sonar.structured_output.compiler import GrammarCompiler
from sonar.structured_output.matcher import RequestGrammar
from sonar.structured_output.params import GuidedDecodingParams


def schema(rng: random.Random, i: int) -> dict:
    properties = {
        f"id_{i}": {"type": "integer", "minimum": 0, "maximum": 10_000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma", f"delta_{i}"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 8},
    }
    if rng.random() < 0.5:
        properties["nested"] = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    return {"type": "object", "properties": properties, "required": list(properties)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer folder (default: SmolLM2's, from its GGUF)")
    args = parser.parse_args()

    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from sonar_models.testing import smollm2_tokenizer

        tokenizer = smollm2_tokenizer()
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    rng = random.Random(0)
    started = time.perf_counter()
    compiled = [compiler.compile(GuidedDecodingParams(json=schema(rng, i))) for i in range(args.batch)]
    compile_ms = (time.perf_counter() - started) * 1e3 / args.batch
    grammars = [RequestGrammar(c) for c in compiled]
    bitmask = GrammarBitmask(vocab)
    device = torch.device(args.device)

    fill_apply_ms: list[float] = []
    for _ in range(args.steps):
        logits = torch.randn(args.batch, vocab, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        bitmask.apply(logits, grammars)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fill_apply_ms.append((time.perf_counter() - started) * 1e3)
        for grammar, token in zip(grammars, logits.argmax(dim=-1).tolist()):
            if grammar.active:
                grammar.accept(token)
        grammars = [g if g.active else RequestGrammar(c) for g, c in zip(grammars, compiled)]  # restart finished ones

    print(f"batch {args.batch}, vocab {vocab}, device {args.device}, {args.steps} steps")
    print(f"compile (cold, per schema): {compile_ms:.2f} ms")
    print(f"mask per step (fill + apply): median {statistics.median(fill_apply_ms):.2f} ms, p90 {sorted(fill_apply_ms)[int(0.9 * len(fill_apply_ms))]:.2f} ms")


if __name__ == "__main__":
    main()
