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
import json
import random
from pathlib import Path
from typing import Any

MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048  # vLLM's ShareGPT filter
DATASETS = ("random", "sharegpt", "custom")
TOKENIZE_AT_ONCE = 32


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """The (first human turn, first reply) of each conversation with at least two turns."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path!r} is not a readable ShareGPT JSON file: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r}: a ShareGPT file holds a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict) and isinstance(first.get("value"), str) and isinstance(second.get("value"), str):
            pairs.append((first["value"], second["value"]))
    if not pairs:
        raise ValueError(f"--dataset-path {path!r} holds no conversation with a prompt and a reply")
    return pairs


def read_custom(path: str) -> list[str]:
    """Each line's ``prompt`` (or first of its ``turns``)."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--dataset-path {path!r} cannot be read: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--dataset-path {path!r} line {number} is not JSON: {exc}") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if prompt is None and isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            prompt = row["turns"][0]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"--dataset-path {path!r} line {number} has no \"prompt\" string (nor \"turns\")")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--dataset-path {path!r} holds no prompt")
    return prompts


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
        lengths = await count_tokens(client, base_url, model, list(dict.fromkeys(chosen)))
        length_of = dict(zip(dict.fromkeys(chosen), lengths))
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
            if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS or prompt_len > MAX_PROMPT_TOKENS or prompt_len + output_len > MAX_TOTAL_TOKENS:
                continue
            usable.append((prompt, prompt_len, output_len))
        if len(usable) >= args.num_prompts:
            break
    if not usable:
        raise ValueError(f"--dataset-path {args.dataset_path!r}: no conversation passes the length filter (prompt and reply of 4+ tokens, prompt up to 1,024, both up to 2,048)")
    return [usable[i % len(usable)] for i in range(args.num_prompts)]
