"""LoRA adapters as the HTTP server sees them: the ``--lora-modules`` values, adapter names a
client may use in ``model``, and the confinement of runtime-loaded paths to ``--lora-root``.

The engine cores hold the loaded set and validate an adapter's tensors; this module only
decides what the server may ask them to load. Everything here reads the file system and
none of it runs on the event loop (callers use ``asyncio.to_thread``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

# names clients send in ``model``: no whitespace, control characters or quotes, at most 128
# characters, so they print safely in logs and error messages
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}")
MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")


class LoRAPathError(ValueError):
    """An adapter path the server will not hand to the engine (the message says why)."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the adapter's name, its folder and, optionally, the
    served model name it is listed under as ``parent`` in ``/v1/models``."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_adapter_name(self.name)
        if not self.path:
            raise ValueError(f"LoRA adapter {self.name!r} needs a path")


def check_adapter_name(name: object) -> str:
    """``name`` if clients may call an adapter by it, else ValueError saying what is allowed."""
    if not isinstance(name, str):
        raise ValueError(f"an adapter name must be a string, got {type(name).__name__}")
    if not _NAME.fullmatch(name):
        shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."
        raise ValueError(
            f"adapter name {shown!r} is not allowed: use 1 to {MAX_NAME_CHARS} characters of letters, digits and . _ : @ + / -, "
            "starting with a letter or digit"
        )
    return name


def parse_lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"--lora-modules {text!r}: the JSON form is an object with name and path")
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown key(s) {unknown}; the keys are name, path and base_model_name")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        for key, value in (("name", name), ("path", path)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"--lora-modules {text!r}: {key} must be a non-empty string")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        return LoRAModule(name, path, base or None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} is not name=path (or the JSON form {{\"name\": ..., \"path\": ...}})")
    return LoRAModule(name.strip(), path.strip())


def check_adapter_folder(path: str, root: str | None = None) -> None:
    """Raise LoRAPathError unless ``path`` is a folder in PEFT's layout with safetensors
    weights; with ``root``, also unless each of its entries that is a symlink stays in it."""
    if not os.path.isdir(path):
        raise LoRAPathError(f"{_shown(path, root)} is not a folder (an adapter is a folder holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    if root is not None:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_symlink() and not _inside(os.path.realpath(entry.path), root):
                    raise LoRAPathError(f"{_shown(entry.path, root)} is a symlink that leads out of --lora-root")
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        raise LoRAPathError(f"{_shown(path, root)} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        pickled = [name for name in _PICKLED_WEIGHTS if os.path.exists(os.path.join(path, name))]
        if pickled:
            raise LoRAPathError(f"{_shown(path, root)} holds {pickled[0]}, a pickle: Sonar loads adapters from {ADAPTER_WEIGHTS} only (convert it with safetensors)")
        raise LoRAPathError(f"{_shown(path, root)} holds no {ADAPTER_WEIGHTS}")


def confine_adapter_path(root: str, requested: object) -> str:
    """The real path of the adapter folder ``requested`` names under ``root`` (a path relative
    to it, or an absolute one inside it), checked with ``check_adapter_folder``.

    Refused, with LoRAPathError: non-strings, empty or overlong paths, control characters, any
    ``..`` component, absolute paths outside ``root``, and paths that symlinks lead out of it.
    """
    if not isinstance(requested, str):
        raise LoRAPathError(f"lora_path must be a string, got {type(requested).__name__}")
    if not requested or len(requested) > MAX_PATH_CHARS:
        raise LoRAPathError(f"lora_path must be 1 to {MAX_PATH_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in requested):
        raise LoRAPathError("lora_path must not contain control characters")
    if ".." in re.split(r"[/\\]", requested):
        raise LoRAPathError(f"lora_path {requested!r} contains '..': name a folder under --lora-root")
    real_root = os.path.realpath(root)
    candidate = requested if os.path.isabs(requested) else os.path.join(real_root, requested)
    if os.path.isabs(requested) and not _inside(os.path.abspath(requested), real_root) and not _inside(os.path.abspath(requested), os.path.abspath(root)):
        raise LoRAPathError(f"lora_path {requested!r} is outside --lora-root")
    resolved = os.path.realpath(candidate)
    if not _inside(resolved, real_root):
        raise LoRAPathError(f"lora_path {requested!r} leads out of --lora-root (through a symlink)")
    if not os.path.exists(resolved):
        raise LoRAPathError(f"lora_path {requested!r} does not exist under --lora-root")
    check_adapter_folder(resolved, real_root)
    return resolved


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _shown(path: str, root: str | None) -> str:
    """``path`` as a client may see it: relative to ``root``, so errors never reveal where on
    the host the adapters are kept."""
    if root is not None:
        return repr(os.path.relpath(path, root))
    return repr(path)
