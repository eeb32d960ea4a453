"""Prompt files: JSON lines, one prompt a line, in the fields the public prompt sets use
(``turns``, of which the first, ``prompt``, ``text``, ``question``, ``instruction``). The drafter
trainer and the benchmarks read them the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPT_FIELDS = ("turns", "prompt", "text", "question", "instruction")


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a JSON-lines file: each line's ``turns`` (its first turn), ``prompt``,
    ``text``, ``question`` or ``instruction`` field.

    :raises ValueError: a line that is not JSON or has none of those fields (its number named).
    """
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
        value = prompt_text(record)
        if value is None:
            raise ValueError(f"{path}:{number}: needs a text field ({', '.join(PROMPT_FIELDS)})")
        prompts.append(value)
    return prompts


def prompt_text(record: Any) -> str | None:
    """A prompt record's text: its ``turns`` (the first), ``prompt``, ``text``, ``question`` or
    ``instruction`` field; None where it has none of them."""
    value = next((record[f] for f in PROMPT_FIELDS if isinstance(record, dict) and f in record), None)
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) and value.strip() else None
