"""What tool-call and reasoning parsers return, and the base classes plugins subclass.

JSON in a model's text is read strictly (``strict_json``): ``NaN``, ``Infinity``, ``-Infinity``
and numbers that overflow a double make it not JSON, so a call that holds them is no call and
its text stays content; every call's ``arguments`` is a string of RFC 8259 JSON."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sonar_server import strict_json


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One call the model made: a function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    @property
    def input(self) -> Any:
        """The arguments as a value (Anthropic's ``tool_use.input``); ``{}`` if they are not JSON."""
        try:
            return strict_json.loads(self.arguments)
        except (ValueError, RecursionError):
            return {}


@dataclass(slots=True)
class ToolCallResult:
    """A model's output split into its plain text and its tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def arguments_text(value: Any) -> str | None:
    """Arguments as strict JSON text: a dict is serialised; a string must already be strict
    JSON; else (or if they hold a non-finite number) None."""
    try:
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        if isinstance(value, str):
            strict_json.loads(value)
            return value
    except (ValueError, RecursionError):
        return None
    return None


def call_from_object(item: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A ``{"name": ..., "arguments": {...}}`` object as a ToolCall, or None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    value = next((item[key] for key in arguments_keys if key in item), {})
    arguments = arguments_text(value)
    return None if arguments is None else ToolCall(item["name"], arguments)


def decode_json_prefix(text: str, start: int = 0) -> tuple[Any, int] | None:
    """The strict JSON value beginning at ``text[start]`` (after whitespace) and the index after
    it, or None. Linear in what it reads; too-deep nesting is a failure, not a crash."""
    try:
        return strict_json.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker`` (to hold back when streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser:
    """Finds tool calls in a model's text. Subclasses set ``name`` and implement ``extract``,
    ``find_start`` and ``held_back``; they must run in time linear in the text and never raise
    on bad output (a parse failure is plain content)."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens kept in the text

    def extract(self, text: str) -> ToolCallResult:
        """Split a whole output into content and tool calls."""
        raise NotImplementedError

    def find_start(self, text: str, start: int) -> int:
        """Index where tool-call text begins at or after ``start``, or -1."""
        raise NotImplementedError

    def held_back(self, text: str, emitted: int) -> int:
        """How many trailing characters of ``text`` (of which ``emitted`` were already streamed
        as content) might still begin tool-call text and must not be streamed yet."""
        raise NotImplementedError


class ReasoningParser:
    """Separates a model's reasoning from its answer. Subclasses set ``name``, the tags, and
    ``starts_in_reasoning`` (the chat template opened the reasoning block itself)."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = False

    def extract(self, text: str) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of a whole output."""
        stripped = text.lstrip()
        opened = stripped.startswith(self.start_tag)
        if opened:
            text = stripped[len(self.start_tag):]
        elif not self.starts_in_reasoning:
            return None, text
        end = text.find(self.end_tag)
        if end < 0:
            return text, ""
        return text[:end], text[end + len(self.end_tag):]
