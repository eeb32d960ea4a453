"""Reasoning parsers on recorded model-style outputs, whole and streamed in pieces of every
size, and adversarial ones that must finish fast."""

from __future__ import annotations

import time

import pytest
from sonar_server.parsers import ReasoningStream, make_reasoning_parser
from sonar_server.tool_calling import OutputParser, ToolPlan

RECORDED = [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("qwen3", "  <think>short</think>Answer", "short", "Answer"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "<think>still thinking when cut off", "still thinking when cut off", ""),
    ("qwen3", "<think></think>Direct.", "", "Direct."),
    ("deepseek_r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>Repeated open tag.</think>Done", "Repeated open tag.", "Done"),
    ("deepseek_r1", "Thinking that never ends", "Thinking that never ends", ""),
    ("deepseek_r1", "a < b, and </thin is not a tag</think>ok", "a < b, and </thin is not a tag", "ok"),
]


def streamed(name: str, text: str, size: int) -> tuple[str, str]:
    stream = ReasoningStream(make_reasoning_parser(name))
    pieces = []
    for start in range(0, len(text), size):
        pieces += stream.feed(text[start : start + size])
    pieces += stream.finish()
    return "".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "content")


@pytest.mark.parametrize("name, text, reasoning, content", RECORDED)
def test_recorded_outputs(name: str, text: str, reasoning: str | None, content: str) -> None:
    assert make_reasoning_parser(name).extract(text) == (reasoning, content)
    for size in range(1, len(text) + 1):
        got_reasoning, got_content = streamed(name, text, size)
        assert got_reasoning == (reasoning or "") and got_content.lstrip() == content.lstrip(), size


def test_reasoning_then_tool_call() -> None:
    from sonar_server.parsers import make_tool_parser

    plan = ToolPlan("auto", parser=make_tool_parser("hermes"))
    text = '<think>Need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = OutputParser(plan, make_reasoning_parser("qwen3"), constrained=False).parse(text)
    assert parsed.reasoning == "Need the weather." and parsed.content.strip() == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    stream = OutputParser(plan, make_reasoning_parser("qwen3"), constrained=False)
    events = [e for i in range(0, len(text), 5) for e in stream.feed(text[i : i + 5])] + stream.finish()
    assert "".join(e.text for e in events if e.kind == "reasoning") == "Need the weather."
    assert [e.call.name for e in events if e.kind == "tool_call"] == ["get_weather"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(
    "text",
    ["<think>" + "<" * 500_000, "<think>" + "</think" * 70_000, "[" * 500_000, "<think>" * 70_000, "</think>" * 60_000],
    ids=["unclosed with brackets", "almost-closing tags", "brackets", "open tags", "close tags"],
)
def test_adversarial_outputs_finish_fast(name: str, text: str) -> None:
    started = time.perf_counter()
    reasoning, content = make_reasoning_parser(name).extract(text)
    got_reasoning, got_content = streamed(name, text, 1000)
    assert time.perf_counter() - started < 1.0
    assert (got_reasoning, got_content) == (reasoning or "", content)
    assert len(reasoning or "") + len(content) <= len(text)
