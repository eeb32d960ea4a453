"""Tool-call and reasoning parsers, found through plugins.

A package registers its parsers with the ``sonar_register_tool_parsers`` and
``sonar_register_reasoning_parsers`` hooks of ``sonar_server.hookspecs`` (``register(name,
class_path)``); ``sonar serve --tool-call-parser NAME`` / ``--reasoning-parser NAME`` pick one. sonar-server registers its
built-in ones the same way: ``hermes`` (alias ``qwen``), ``llama3_json`` and ``mistral`` tool
parsers, ``qwen3`` and ``deepseek_r1`` reasoning parsers.

A single Python file given to ``sonar serve --tool-parser-plugin FILE`` registers its tool
parsers with the ``register_tool_parser("name")`` class decorator (vLLM's
``ToolParserManager.register_module("name")``); its names win over the hooks'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    "register_tool_parser",
    "tool_parsers",
]

logger = logging.getLogger(__name__)

_decorated_tool_parsers: dict[str, type[ToolParser]] = {}  # register_tool_parser's, by name


def _registered(hook_name: str) -> dict[str, str | type]:
    from sonar_server.plugin import collect_server_hook

    found: dict[str, str | type] = {}
    for name, target in collect_server_hook(hook_name):
        found.setdefault(name, target)
    return found


def tool_parsers() -> dict[str, str | type]:
    """Every registered tool-call parser: name → class (or ``"module:Class"`` path)."""
    return {**_registered("sonar_register_tool_parsers"), **_decorated_tool_parsers}


def register_tool_parser(name: str | list[str]) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """A class decorator registering a ``ToolParser`` subclass under ``name`` (or each of a
    list of names) for ``--tool-call-parser``: what a ``--tool-parser-plugin`` file uses. A name
    the hooks registered too (a built-in's) is replaced, as vLLM's ``register_module`` does.

    :raises TypeError: the name is not a non-empty string, or the class is no ``ToolParser``."""
    names = [name] if isinstance(name, str) else list(name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"register_tool_parser takes a name or a list of names, got {name!r}")

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"register_tool_parser({name!r}) decorates a sonar_server.parsers.ToolParser subclass, got {cls!r}")
        for each in names:
            if each in _registered("sonar_register_tool_parsers"):
                logger.info("tool-call parser %r of %s replaces the installed one of that name", each, cls.__qualname__)
            _decorated_tool_parsers[each] = cls
        return cls

    return register


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
