"""Built-in tool-call parsers: Hermes/Qwen ``<tool_call>`` JSON, Llama-3 JSON, Mistral
``[TOOL_CALLS]``, and Python-call lists (``pythonic``)."""

from __future__ import annotations

import ast
from typing import ClassVar

from sonar_server.parsers.base import (
    ToolCall,
    ToolCallResult,
    ToolParser,
    call_from_object,
    decode_json_prefix,
    held_prefix,
)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, with
    text around (Hermes, Qwen2.5, Qwen3). An unclosed last call is parsed if its JSON is whole."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def extract(self, text: str) -> ToolCallResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while True:
            start = text.find(self.open_tag, position)
            if start < 0:
                content.append(text[position:])
                break
            content.append(text[position:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            body_end = len(text) if end < 0 else end
            call = self._call(text[body_start:body_end])
            if call is None:
                content.append(text[start:])  # not a call after all: the rest stays text
                break
            calls.append(call)
            if end < 0:
                break
            position = end + len(self.close_tag)
        return ToolCallResult("".join(content), calls)

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        decoded = decode_json_prefix(body)
        if decoded is None or body[decoded[1]:].strip():
            return None
        return call_from_object(decoded[0])

    def find_start(self, text: str, start: int) -> int:
        return text.find(self.open_tag, start)

    def held_back(self, text: str, emitted: int) -> int:
        return held_prefix(text, self.open_tag)


class WholeOutputToolParser(ToolParser):
    """A format whose calls are the whole output: it begins with ``lead_tag`` or with
    ``opening`` (after whitespace), or it holds no call."""

    lead_tag: ClassVar[str] = ""
    opening: ClassVar[str] = ""

    def find_start(self, text: str, start: int) -> int:
        if start > 0:
            return -1  # text was already streamed as content: the output is not a call
        stripped = text.lstrip()
        if stripped.startswith((self.lead_tag, self.opening)):
            return len(text) - len(stripped)
        return -1

    def held_back(self, text: str, emitted: int) -> int:
        if emitted:
            return 0  # content already began: this output holds no call
        stripped = text.lstrip()
        return len(text) if self.lead_tag.startswith(stripped) else 0


class Llama3JsonToolParser(WholeOutputToolParser):
    """Llama 3.1+ JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}``
    (optionally after ``<|python_tag|>``), several separated by ``;``."""

    name = "llama3_json"
    needs_special_tokens = True
    python_tag = lead_tag = "<|python_tag|>"
    opening = "{"

    def extract(self, text: str) -> ToolCallResult:
        start = self.find_start(text, 0)
        if start < 0:
            return ToolCallResult(text)
        position = start + len(self.python_tag) if text.startswith(self.python_tag, start) else start
        calls: list[ToolCall] = []
        while True:
            decoded = decode_json_prefix(text, position)
            if decoded is None:
                return ToolCallResult(text)
            call = call_from_object(decoded[0])
            if call is None:
                return ToolCallResult(text)
            calls.append(call)
            position = decoded[1]
            while position < len(text) and text[position].isspace():
                position += 1
            if position == len(text):
                return ToolCallResult(text[:start], calls)
            if text[position] != ";":
                return ToolCallResult(text)
            position += 1



class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (v3 tokenizers), or
    ``name[ARGS]{...}`` per call (v11+)."""

    name = "mistral"
    needs_special_tokens = True
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def extract(self, text: str) -> ToolCallResult:
        parts = text.split(self.marker)
        if len(parts) == 1:
            return ToolCallResult(text)
        calls: list[ToolCall] = []
        for part in parts[1:]:
            found = self._calls(part)
            if found is None:
                return ToolCallResult(text)
            calls.extend(found)
        return ToolCallResult(parts[0], calls)

    def _calls(self, part: str) -> list[ToolCall] | None:
        stripped = part.strip()
        if stripped.startswith("["):
            decoded = decode_json_prefix(stripped)
            if decoded is None or stripped[decoded[1]:].strip() or not isinstance(decoded[0], list):
                return None
            calls = [call_from_object(item) for item in decoded[0]]
            return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
        name, found, arguments = stripped.partition(self.args_marker)
        if not found or not name.strip():
            return None
        decoded = decode_json_prefix(arguments)
        if decoded is None or arguments[decoded[1]:].strip():
            return None
        call = call_from_object({"name": name.strip(), "arguments": decoded[0]})
        return None if call is None else [call]

    def find_start(self, text: str, start: int) -> int:
        return text.find(self.marker, start)

    def held_back(self, text: str, emitted: int) -> int:
        return held_prefix(text, self.marker)




class PythonicToolParser(WholeOutputToolParser):
    """Python-call tool calls (Llama 3.2 and 4, ToolACE): the whole output is a list of calls
    with keyword arguments, ``[get_weather(city="Paris", days=3), get_time()]``, optionally
    inside ``<|python_start|>`` / ``<|python_end|>``. Argument values must be Python literals
    (strings, numbers, booleans, None, lists, dicts); anything else makes the output plain text."""

    name = "pythonic"
    start_tag = lead_tag = "<|python_start|>"
    end_tag = "<|python_end|>"
    opening = "["

    def extract(self, text: str) -> ToolCallResult:
        start = self.find_start(text, 0)
        if start < 0:
            return ToolCallResult(text)
        body = text[start:].strip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
            body = body[: -len(self.end_tag)] if body.endswith(self.end_tag) else body
        calls = self._calls(body.strip())
        return ToolCallResult(text) if calls is None else ToolCallResult(text[:start], calls)

    @staticmethod
    def _calls(body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List):
            return None
        calls: list[ToolCall] = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            arguments: dict[str, object] = {}
            for keyword in node.keywords:
                if keyword.arg is None:  # **kwargs
                    return None
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return None
            call = call_from_object({"name": ast.unparse(node.func), "arguments": arguments})
            if call is None:  # a value JSON cannot hold (a set, bytes, an infinite float)
                return None
            calls.append(call)
        return calls

