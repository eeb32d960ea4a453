"""What a speculative step costs beyond the model: a tiny random target and a random DSpark
drafter, so the forward passes are cheap and the host's and the drafter's per-step work shows.

    python sonar-cuda/benchmarks/spec_step_cost.py [--batches 1,64] [--output-json F]

For each batch size: output tok/s and milliseconds per step with no speculation, and with
DSpark at 7 drafts a step under fixed-length verification (drafting at every batch size). A
random drafter's drafts are all rejected, so every speculative step emits one token per request
and verifies eight: its time per step is the whole cost of drafting and verifying. Runs on a
GPU, or on the CPU where there is none.
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
from safetensors.torch import load_file

from sonar import LLM, SamplingParams
from sonar.spec_decode.dflash_checkpoint import save_dflash
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
from sonar.spec_decode.interface import NO_BATCH_LIMIT

VOCAB = 4096
OUTPUT_LEN = 64


def build(root: Path) -> tuple[Path, Path]:
    """A 4-layer random Llama (hidden 64) and a random DSpark drafter for it (7-slot blocks)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    target = root / "target"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    hf = AutoConfig.from_pretrained(target)
    drafter_config = drafter_config_for(hf, "deepspec", 7, 2, [-1, 1, 2], VOCAB - 1, markov_rank=16, markov_head_type="vanilla", confidence_head=True)
    weights = load_file(str(target / "model.safetensors"))
    drafter = root / "drafter"
    save_dflash(init_drafter(DFlashDrafter(drafter_config), std=0.1, seed=0), drafter,
                embedding=weights["model.embed_tokens.weight"], lm_head=weights["lm_head.weight"])  # fmt: skip
    return target, drafter


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB - 1) for _ in range(32)]} for _ in range(max(batches))]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True, detokenize=False)
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        for name in ("none", "fixed"):
            spec = None if name == "none" else {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 7,
                                                 "verification": "fixed", "disable_by_batch_size": NO_BATCH_LIMIT}  # fmt: skip
            options = {"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}
            llm = LLM(str(target), max_model_len=512, max_num_seqs=max(batches), enable_prefix_caching=False,
                      speculative_config=spec, skip_tokenizer_init=True, **options)  # fmt: skip
            llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
            for batch in batches:
                sync()
                started = time.perf_counter()
                outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
                sync()
                seconds = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                results.setdefault(name, {})[batch] = {"tok_s": round(tokens / seconds, 1), "ms_per_step": round(1000 * seconds / OUTPUT_LEN, 3)}
                print(name, batch, results[name][batch], file=sys.stderr, flush=True)
            del llm
    line = json.dumps(results)
    print(line)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
