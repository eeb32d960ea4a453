"""Finding and loading a Hugging Face tokenizer stored next to a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds any Hugging Face tokenizer file."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_folder_tokenizer(folder: Path) -> Any | None:
    """The folder's tokenizer, or None where it has no tokenizer files (token-id-only serving)."""
    if not has_tokenizer_files(folder):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
