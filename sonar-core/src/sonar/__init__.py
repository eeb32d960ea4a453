"""Sonar: a plugin-based LLM inference engine.

Public names are imported lazily so that ``import sonar.hookspecs`` (done by every plugin)
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "sonar.entrypoints.llm",
    "SamplingParams": "sonar.sampling_params",
    "RequestOutputKind": "sonar.sampling_params",
    "TextPrompt": "sonar.inputs",
    "TokensPrompt": "sonar.inputs",
    "RequestOutput": "sonar.outputs",
    "CompletionOutput": "sonar.outputs",
    "Logprob": "sonar.outputs",
    "EngineArgs": "sonar.config",
    "LoRARequest": "sonar.lora.request",
    "BeamSearchParams": "sonar.beam_search",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'sonar' has no attribute {name!r}")
