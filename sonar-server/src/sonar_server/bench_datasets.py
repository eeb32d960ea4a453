"""Prompt sets of real text for ``sonar bench serve``, under vLLM's dataset names.

- ``sharegpt``: a ShareGPT JSON file (a list of ``{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}``). Each conversation's first turn is the
  prompt and the reply's length in tokens the output length (or ``--sharegpt-output-len``);
  as in vLLM, pairs with a prompt or reply under 4 tokens, a prompt over 1,024 or both over
  2,048 are skipped.
- ``custom``: a JSON-lines file, one ``{"prompt": ...}`` (or ``{"turns": [...]}``, whose first
  turn is used) a line, each asking for ``--custom-output-len`` tokens.

Prompts go as text (the server tokenizes them); lengths are counted by the server's own
``/tokenize``. Both files are shuffled with ``--seed``; a file with fewer usable prompts than
``--num-prompts`` is cycled.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from sonar.cli.bench_datasets import DATASETS, read_custom, read_sharegpt, usable_pair

__all__ = ["DATASETS", "dataset_requests"]

TOKENIZE_AT_ONCE = 32


async def count_tokens(client: Any, base_url: str, model: str, texts: list[str]) -> list[int]:
    """Each text's length in the server's tokens (``/tokenize``, a few requests at a time)."""
    counts: list[int] = []
    for start in range(0, len(texts), TOKENIZE_AT_ONCE):
        batch = texts[start : start + TOKENIZE_AT_ONCE]
        replies = await asyncio.gather(
            *(client.post(f"{base_url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}) for text in batch)
        )
        for reply in replies:
            if reply.status_code != 200:
                raise RuntimeError(f"POST {base_url}/tokenize (the dataset's lengths use the server's tokenizer) answered {reply.status_code}")
            counts.append(int(reply.json()["count"]))
    return counts


async def dataset_requests(args: argparse.Namespace, client: Any, base_url: str, model: str) -> list[tuple[str, int, int]]:
    """``(prompt text, prompt tokens, output tokens)`` for ``--num-prompts`` requests of the
    ``--dataset-name`` file."""
    rng = random.Random(args.seed)
    if args.dataset_name == "custom":
        prompts = read_custom(args.dataset_path)
        rng.shuffle(prompts)
        chosen = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
        distinct = list(dict.fromkeys(chosen))
        length_of = dict(zip(distinct, await count_tokens(client, base_url, model, distinct)))
        return [(prompt, length_of[prompt], args.custom_output_len) for prompt in chosen]
    pairs = read_sharegpt(args.dataset_path)
    rng.shuffle(pairs)
    usable: list[tuple[str, int, int]] = []
    for start in range(0, len(pairs), TOKENIZE_AT_ONCE):
        batch = pairs[start : start + TOKENIZE_AT_ONCE]
        prompt_lens = await count_tokens(client, base_url, model, [prompt for prompt, _ in batch])
        reply_lens = await count_tokens(client, base_url, model, [reply for _, reply in batch])
        for (prompt, _), prompt_len, reply_len in zip(batch, prompt_lens, reply_lens):
            output_len = args.sharegpt_output_len or reply_len
            if usable_pair(prompt_len, output_len):
                usable.append((prompt, prompt_len, output_len))
        if len(usable) >= args.num_prompts:
            break
    if not usable:
        raise ValueError(f"--dataset-path {args.dataset_path!r}: no conversation passes the length filter (prompt and reply of 4+ tokens, prompt up to 1,024, both up to 2,048)")
    return [usable[i % len(usable)] for i in range(args.num_prompts)]
