"""Prompt sets of real text for benchmarks, under vLLM's dataset names: ``sharegpt`` (a
ShareGPT JSON file: each conversation's first turn as the prompt, its reply's length as the
output length) and ``custom`` (a prompt file, ``sonar.prompt_files``: JSON lines of
``{"prompt": ...}``, ``{"turns": [...]}``, ...).
``sonar bench throughput`` and ``sonar bench serve`` read them the same way."""

from __future__ import annotations

import json
from pathlib import Path

from sonar.prompt_files import read_prompts

DATASETS = ("random", "sharegpt", "custom")
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048  # vLLM's ShareGPT filter


def usable_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter: prompt and reply of 4+ tokens, prompt up to 1,024, both up to 2,048."""
    return MIN_TOKENS <= prompt_len <= MAX_PROMPT_TOKENS and output_len >= MIN_TOKENS and prompt_len + output_len <= MAX_TOTAL_TOKENS


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
    """The prompts of a JSON-lines file (``sonar.prompt_files``: ``prompt``, the first of
    ``turns``, ...)."""
    try:
        prompts = read_prompts(path)
    except OSError as exc:
        raise ValueError(f"--dataset-path {path!r} cannot be read: {exc.strerror or exc}") from None
    if not prompts:
        raise ValueError(f"--dataset-path {path!r} holds no prompt")
    return prompts
