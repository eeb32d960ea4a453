"""Default sampling from the model (``generation_config="auto"``, as vLLM's
``--generation-config auto``): the sampling fields of its ``generation_config.json`` become the
defaults of every request that leaves them out; a request's own fields always win.

The embedded SmolLM2-135M-Instruct GGUF has no ``generation_config.json``; its defaults are
the sampling its authors' model card uses for the Instruct model (temperature 0.2, top_p 0.9).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sonar.config import DEFAULT_MODEL_FILE

# generation_config.json field -> SamplingParams field
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
EMBEDDED_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}
ENGINE_DEFAULTS = ("vllm", "sonar")  # generation_config values meaning: SamplingParams' own defaults


def default_sampling_of(
    model_path: Path, generation_config: str = "auto", overrides: dict[str, Any] | None = None
) -> dict[str, float | int]:
    """The ``SamplingParams`` fields the model recommends: from ``generation_config.json`` in
    ``model_path`` (``"auto"``) or in the folder ``generation_config``; none for ``"vllm"``;
    then ``overrides`` (``generation_config.json`` field names, as vLLM's
    ``--override-generation-config``) laid over them, whichever ``generation_config`` is."""
    defaults = _recommended_sampling(model_path, generation_config)
    defaults.update(_sampling_fields(overrides or {}, "override_generation_config", strict=True))
    return defaults


def check_override_generation_config(overrides: dict[str, Any]) -> None:
    """Raises ValueError naming a field of ``overrides`` that is not a numeric sampling field."""
    _sampling_fields(overrides, "override_generation_config", strict=True)


def _recommended_sampling(model_path: Path, generation_config: str) -> dict[str, float | int]:
    if generation_config in ENGINE_DEFAULTS:
        return {}
    if generation_config == "auto":
        folder = model_path if model_path.is_dir() else model_path.parent
        if model_path.is_file() and model_path.name == DEFAULT_MODEL_FILE:
            return dict(EMBEDDED_MODEL_SAMPLING)
    else:
        folder = Path(generation_config).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config={generation_config!r}: no generation_config.json in that folder (or pass auto or vllm)")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    return _sampling_fields(values, str(file), strict=False)


def _sampling_fields(values: dict[str, Any], source: str, strict: bool) -> dict[str, float | int]:
    """The sampling fields of generation-config ``values``; with ``strict``, a field of
    another name or a value that is not a number is an error naming it."""
    if not isinstance(values, dict):
        raise ValueError(f"{source} must be a JSON object of generation_config.json fields, got {values!r}")
    fields: dict[str, float | int] = {}
    for name, value in values.items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in GENERATION_CONFIG_FIELDS and numeric:
            fields[GENERATION_CONFIG_FIELDS[name]] = value
        elif strict and name not in GENERATION_CONFIG_FIELDS:
            raise ValueError(f"{source}: {name!r} is not a sampling field of generation_config.json (accepted: {', '.join(GENERATION_CONFIG_FIELDS)})")
        elif strict:
            raise ValueError(f"{source}: {name} must be a number, got {value!r}")
    return fields
