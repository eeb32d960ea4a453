"""Parsers applied to streamed text: each delta is split into reasoning, content and tool-call
events as early as is safe. Work per delta is bounded by the delta and the tags' lengths, so a
whole stream costs time linear in its text."""

from __future__ import annotations

from dataclasses import dataclass

from sonar_server.parsers.base import ReasoningParser, ToolCall, ToolParser, held_prefix
from sonar_server.parsers.partial import with_cut_call


@dataclass(slots=True)
class StreamEvent:
    """One piece of a streamed output.

    ``kind`` is ``"reasoning"`` or ``"content"`` (``text`` set), ``"tool_call"`` (a new call:
    ``call`` set, with ``text`` its first arguments text) or ``"arguments"`` (more arguments
    text of the call ``index``)."""

    kind: str
    text: str = ""
    index: int = 0
    call: ToolCall | None = None


class ReasoningStream:
    """Splits streamed text into reasoning and content with a ``ReasoningParser``'s tags."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = "start"
        self._pending = ""

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """``[(kind, text)]`` that can be sent now (kind ``"reasoning"`` or ``"content"``)."""
        self._pending += delta
        out: list[tuple[str, str]] = []
        if self._state == "start":
            stripped = self._pending.lstrip()
            tag = self.parser.start_tag
            if len(stripped) < len(tag) and tag.startswith(stripped):
                return out  # may still become the opening tag
            if stripped.startswith(tag):
                self._pending = stripped[len(tag):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.parser.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._pending.find(self.parser.end_tag)
            if end >= 0:
                if end:
                    out.append(("reasoning", self._pending[:end]))
                self._pending = self._pending[end + len(self.parser.end_tag):]
                self._state = "content"
            else:
                keep = held_prefix(self._pending, self.parser.end_tag)
                ready = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(ready):]
                if ready:
                    out.append(("reasoning", ready))
        if self._state == "content" and self._pending:
            out.append(("content", self._pending))
            self._pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the output is complete."""
        pending, self._pending = self._pending, ""
        if not pending:
            return []
        if self._state == "reasoning" or (self._state == "start" and self.parser.starts_in_reasoning):
            return [("reasoning", pending)]
        return [("content", pending)]


class ToolCallStream:
    """Streams content until a ``ToolParser`` sees tool-call text begin; from there buffers, and
    parses the calls when the output is complete (text that does not parse is sent as content)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._emitted = 0  # characters of _text sent as content
        self._tool_start = -1

    def feed(self, delta: str) -> list[StreamEvent]:
        search_from = self._emitted
        self._text += delta
        if self._tool_start >= 0:
            return []
        start = self.parser.find_start(self._text, search_from)
        if start >= 0:
            self._tool_start = start
            end = start
        else:
            end = len(self._text) - self.parser.held_back(self._text, self._emitted)
        if end <= self._emitted:
            return []
        piece = self._text[self._emitted:end]
        self._emitted = end
        return [StreamEvent("content", piece)]

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The calls (and content) of the complete text; ``truncated``: the output was cut by
        ``max_tokens``, so a call it began is returned as a call with its partial arguments."""
        if self._tool_start < 0:
            rest = self._text[self._emitted:]
            self._emitted = len(self._text)
            return [StreamEvent("content", rest)] if rest else []
        result = self.parser.extract(self._text)
        if truncated:
            result = with_cut_call(self.parser, result)
        events: list[StreamEvent] = []
        sent = self._text[: self._emitted]
        rest = result.content[len(sent):] if result.content.startswith(sent) else result.content[self._emitted:]
        if rest.strip() or (rest and not result.tool_calls):
            events.append(StreamEvent("content", rest))
        for index, call in enumerate(result.tool_calls):
            events.append(StreamEvent("tool_call", call.arguments, index, call))
        return events
