"""Tool-call and reasoning parsers, found through plugins.

A package registers its parsers with the ``sonar_register_tool_parsers`` and
``sonar_register_reasoning_parsers`` hooks of ``sonar_server.hookspecs`` (``register(name,
class_path)``); ``sonar serve --tool-call-parser NAME`` / ``--reasoning-parser NAME`` pick one. sonar-server registers its
built-in ones the same way: ``hermes`` (alias ``qwen``), ``llama3_json`` and ``mistral`` tool
parsers, ``qwen3`` and ``deepseek_r1`` reasoning parsers.
"""

from __future__ import annotations

from typing import Any

from sonar_server.parsers.base import (
    ReasoningParser,
    ToolCall,
    ToolCallResult,
    ToolParser,
)
from sonar_server.parsers.streaming import ReasoningStream, StreamEvent, ToolCallStream

__all__ = [
    "ReasoningParser",
    "ReasoningStream",
    "StreamEvent",
    "ToolCall",
    "ToolCallResult",
    "ToolCallStream",
    "ToolParser",
    "make_reasoning_parser",
    "make_tool_parser",
    "reasoning_parsers",
    "tool_parsers",
]


def _registered(hook_name: str) -> dict[str, str | type]:
    from sonar_server.plugin import collect_server_hook

    found: dict[str, str | type] = {}
    for name, target in collect_server_hook(hook_name):
        found.setdefault(name, target)
    return found


def tool_parsers() -> dict[str, str | type]:
    """Every registered tool-call parser: name → class (or ``"module:Class"`` path)."""
    return _registered("sonar_register_tool_parsers")


def reasoning_parsers() -> dict[str, str | type]:
    """Every registered reasoning parser: name → class (or ``"module:Class"`` path)."""
    return _registered("sonar_register_reasoning_parsers")


def _make(kind: str, name: str, registered: dict[str, str | type]) -> Any:
    if name not in registered:
        raise ValueError(f"unknown {kind} parser {name!r}; registered: {sorted(registered)} (install the plugin that provides it)")
    target = registered[name]
    if isinstance(target, str):
        from sonar.registry import import_class

        target = import_class(target)
    return target()


def make_tool_parser(name: str) -> ToolParser:
    """A new instance of the tool-call parser registered as ``name``."""
    return _make("tool-call", name, tool_parsers())


def make_reasoning_parser(name: str) -> ReasoningParser:
    """A new instance of the reasoning parser registered as ``name``."""
    return _make("reasoning", name, reasoning_parsers())
