"""Tool calls cut off by ``max_tokens``: the name and the arguments text written so far, so
a truncated call still reaches the client as a call (``finish_reason: "length"``), never as
plain text.

The JSON shapes read are the ones Sonar's grammars and tool prompt produce:
``{"name": "f", "arguments": {...`` (or ``"parameters"``), alone or as items of a list."""

from __future__ import annotations

import re

from sonar_server.parsers.base import (
    ToolCall,
    ToolCallResult,
    ToolParser,
    call_from_object,
    decode_json_prefix,
)

_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_NAME_BEGUN = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)$')
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def partial_call(text: str, names: tuple[str, ...] = ()) -> ToolCall | None:
    """The call an unfinished ``{"name": ..., "arguments": ...`` object begins, or None when
    its name is not whole (nor the beginning of exactly one of ``names``, the names a grammar
    allowed). Its ``arguments`` is the (unfinished) JSON text after the key."""
    named = _NAME.match(text.lstrip())
    if named is None:
        begun = _NAME_BEGUN.match(text.lstrip())
        matching = [name for name in names if begun is not None and name.startswith(begun.group(1))]
        return ToolCall(matching[0], "") if len(matching) == 1 else None
    rest = text.lstrip()[named.end():]
    found = _ARGUMENTS.match(rest)
    arguments = rest[found.end():].rstrip() if found else ""
    return ToolCall(named.group(1), arguments)


def partial_call_list(text: str, names: tuple[str, ...] = ()) -> list[ToolCall]:
    """The calls of an unfinished JSON list of call objects: the whole ones, then the cut one
    (``names``: as for ``partial_call``)."""
    position = text.find("[")
    if position < 0 or text[:position].strip():
        return []
    position += 1
    calls: list[ToolCall] = []
    while True:
        while position < len(text) and text[position] in " \n\t\r,":
            position += 1
        decoded = decode_json_prefix(text, position)
        if decoded is None:
            cut = partial_call(text[position:], names)
            return calls + [cut] if cut is not None else calls
        call = call_from_object(decoded[0], ("parameters", "arguments"))
        if call is None:
            return calls
        calls.append(call)
        position = decoded[1]


def with_cut_call(parser: ToolParser, result: ToolCallResult) -> ToolCallResult:
    """``result`` (a ``parser.extract`` of a truncated output) with the call the cut-off text
    began, when its content still holds the start of one."""
    start = parser.find_start(result.content, 0)
    brace = result.content.find("{", start) if start >= 0 else -1
    cut = partial_call(result.content[brace:]) if brace >= 0 else None
    if cut is None:
        return result
    return ToolCallResult(result.content[:start], [*result.tool_calls, cut])
