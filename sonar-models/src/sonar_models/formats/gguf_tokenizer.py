"""The tokenizer of a ``.gguf`` file, converted once and kept on disk.

``transformers`` rebuilds a GGUF file's tokenizer from its metadata (vocabulary, merges) every
time it loads one: seconds for a 49k-token vocabulary, paid by every process that opens the
file. The converted tokenizer is saved (``tokenizer.json``, its config and chat template:
plain JSON and Jinja, nothing executable) under the cache folder, keyed by what the conversion
reads: the file's stored ``tokenizer.*`` metadata, its architecture and name (``transformers``
picks the tokenizer class from them) and the ``transformers`` version. Later loads read it
from there, also for another file with the same tokenizer (the same model in another
quantization). The cache folder is ``$SONAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/sonar``, else
``~/.cache/sonar``; a cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


def cache_root() -> Path:
    """Where Sonar keeps what it derives from model files."""
    if os.environ.get("SONAR_CACHE_DIR"):
        return Path(os.environ["SONAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sonar"


#: the metadata besides ``tokenizer.*`` that ``transformers`` reads to choose the tokenizer
CONVERSION_KEYS = ("general.architecture", "general.name")


def _cache_folder(gguf: Path) -> Path:
    import transformers

    from sonar_models.formats.gguf_metadata import open_gguf

    header = open_gguf(gguf)
    keys = [*CONVERSION_KEYS, *sorted(k for k in header.fields if k.startswith("tokenizer."))]
    key = f"{header.digest(keys)}\0{transformers.__version__}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer ``transformers`` builds from ``gguf``: from the cache where an earlier
    load converted it, else converted now (and saved for the next load)."""
    from transformers import AutoTokenizer

    gguf = Path(gguf)
    folder = _cache_folder(gguf)
    if (folder / TOKENIZER_FILE).is_file():
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as error:  # a damaged entry: convert again
            logger.warning("the cached tokenizer of %s is unreadable (%s); converting it again", gguf.name, error)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _save(tokenizer, folder)
    return tokenizer


#: texts a cached tokenizer must tokenize as the converted one does before it is kept
PROBES = (
    "The capital of France is Paris. Ünïcödé, 12345 tokens!",
    "  leading spaces,\ttabs\nand new lines\n\n  def f(x):\n      return x ** 2  # 中文 café — naïve 🙂",
)


def _save(tokenizer: Any, folder: Path) -> None:
    """Keep ``tokenizer`` under ``folder`` if reading it back gives the same tokenizer:
    ``transformers`` does not always read back what it saved (a BPE vocabulary in a file
    that names Gemma's architecture comes back with Gemma's pre-tokenizer), and such a
    tokenizer is converted on every load instead."""
    from transformers import AutoTokenizer

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=folder.parent))
        try:
            tokenizer.save_pretrained(staging)
            reread = AutoTokenizer.from_pretrained(staging)
        except (OSError, ValueError) as error:
            shutil.rmtree(staging, ignore_errors=True)
            logger.info("not caching the converted tokenizer (%s)", error)
            return
        if _fingerprint(reread) != _fingerprint(tokenizer):
            shutil.rmtree(staging, ignore_errors=True)
            logger.info("not caching the converted tokenizer: transformers reads it back differently")
            return
        try:
            os.replace(staging, folder)  # atomic: a concurrent load sees all of it or none
        except OSError:  # another process saved it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        logger.info("not caching the converted tokenizer (%s)", error)


def _fingerprint(tokenizer: Any) -> tuple:
    specials = "".join(str(token) for token in tokenizer.all_special_tokens)
    return (
        type(tokenizer).__name__, len(tokenizer), tokenizer.bos_token, tokenizer.eos_token, tokenizer.all_special_ids,
        getattr(tokenizer, "chat_template", None), *(tuple(tokenizer.encode(text)) for text in (*PROBES, specials + PROBES[0])),
    )
