"""Where a model's files are: a local folder or ``.gguf`` file, or a Hugging Face Hub id found in
the local Hugging Face cache and downloaded (with a progress bar) where the network allows it.
Also the checks that need only those files, so they run before anything heavy is imported."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

# what Sonar reads from a Hub repository: configs, tokenizers, safetensors weights, templates
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` or ``name``: no path separator beyond the one, no leading ``.`` or ``~``."""
    return bool(_HUB_ID.match(model)) and not model.endswith((".gguf", ".json"))


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local path of ``model``: itself where it exists, else the snapshot of the Hub id
    ``model`` at ``revision`` from the cache (``download_dir`` or the Hugging Face cache),
    downloaded first where it is missing and the network allows it."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(model):
        raise ValueError(f"model {model!r} does not exist (give a Hugging Face folder, a .gguf file or a Hub id such as Qwen/Qwen3-0.6B)")
    return _hub_snapshot(model, revision, download_dir)


def _hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f"{repo_id}@{revision}" if revision else repo_id
    where = download_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    options = dict(repo_id=repo_id, revision=revision, cache_dir=where, allow_patterns=HUB_PATTERNS)
    try:
        return Path(huggingface_hub.snapshot_download(local_files_only=True, **options))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    except HFValidationError as exc:
        raise ValueError(f"model {repo_id!r} is neither a local path nor a valid Hub id: {exc}") from None
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(
            f"model {at} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set, so it cannot be "
            f"downloaded: unset HF_HUB_OFFLINE, fetch it with `hf download {repo_id}` on a machine with network, or give a local folder"
        )
    try:
        return Path(huggingface_hub.snapshot_download(**options))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ValueError(f"model {at} was not found on the Hugging Face Hub (a private or gated model needs HF_TOKEN): {exc}") from None
    except (LocalEntryNotFoundError, OSError) as exc:
        raise ValueError(
            f"model {at} is not in the Hugging Face cache ({where}) and could not be downloaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}); "
            f"check the network, or give a local folder"
        ) from None


def check_remote_code(model_path: Path, trust_remote_code: bool) -> None:
    """Refuse a model whose config or tokenizer names its own code (``auto_map``) unless the
    user allowed it with ``trust_remote_code``."""
    if trust_remote_code or not model_path.is_dir():
        return
    for name in ("config.json", "tokenizer_config.json"):
        file = model_path / name
        if file.is_file() and "auto_map" in _read_json(file):
            raise ValueError(
                f"{model_path / name} names code shipped with the model (auto_map); Sonar runs it only with "
                f"--trust-remote-code (trust_remote_code=True): pass it if you trust the model's author"
            )


def _read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def stretched_context(max_position: int, rope: dict | None) -> int:
    """The positions a model reaches: its ``max_position_embeddings``, or what a stretching
    rope scaling (``rope``: the config's ``rope_parameters`` / ``rope_scaling``) extends it to,
    as vLLM derives it: ``yarn`` the pretraining length (``original_max_position_embeddings``)
    times ``factor``, ``linear`` and ``dynamic`` ``max_position_embeddings`` times ``factor``."""
    rope = rope or {}
    rope_type, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        return max_position
    if rope_type == "yarn":
        return max(max_position, int((rope.get("original_max_position_embeddings") or max_position) * factor))
    if rope_type in ("linear", "dynamic"):
        return int(max_position * factor)
    return max_position


def context_length_of(model_path: Path) -> int | None:
    """The model's context length from its files alone (``max_position_embeddings`` of
    config.json, ``{arch}.context_length`` of a GGUF header), None where they don't say."""
    if model_path.is_dir() and (model_path / "config.json").is_file():
        config = _read_json(model_path / "config.json")
        config = config.get("text_config", config)
        value = config.get("max_position_embeddings")
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        return stretched_context(value, rope if isinstance(rope, dict) else None) if isinstance(value, int) else None
    if model_path.is_file() and model_path.suffix.lower() == ".gguf":
        return _gguf_context_length(model_path)
    return None


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_context_length(path: Path) -> int | None:
    """Scan the GGUF key-value header up to ``{arch}.context_length`` (the full parse of a
    vocabulary takes seconds; this stops at the key, which comes before it)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return None
        _version, _num_tensors, num_kv = struct.unpack("<IQQ", f.read(20))
        architecture = None
        for _ in range(num_kv):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
            kind = struct.unpack("<I", f.read(4))[0]
            if kind == _GGUF_STRING:
                value = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
                if key == "general.architecture":
                    architecture = value
                continue
            if kind == _GGUF_ARRAY:
                item_kind, count = struct.unpack("<IQ", f.read(12))
                if item_kind == _GGUF_STRING:
                    for _ in range(count):
                        f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
                elif item_kind in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[item_kind]), os.SEEK_CUR)
                else:
                    return None
                continue
            if kind not in _GGUF_SCALARS:
                return None
            fmt = "<" + _GGUF_SCALARS[kind]
            value = struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if architecture and key == f"{architecture}.context_length":
                return int(value)
    return None
