"""Tool-call parsers on recorded model-style outputs, whole and streamed, and adversarial ones
(deep brackets, unclosed tags) that must finish fast and fall back to plain content."""

from __future__ import annotations

import json
import time

import pytest
from sonar_server.parsers import ToolCallStream, make_tool_parser
from sonar_server.tool_calling import OutputParser, ToolPlan, ToolSpec

HERMES = (
    "Let me check both cities.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "search", "parameters": {"query": "sonar \\"pings\\""}}'
MISTRAL_V3 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
PYTHONIC = '[get_weather(city="Paris", unit="celsius", days=3), get_time(), search(query=\'sonar "pings"\', filters={"lang": ["en", None]}, exact=True)]'
PYTHONIC_TAGS = '<|python_start|>[module.lookup(key=-1.5e3)]<|python_end|>'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'

RECORDED = [
    ("hermes", HERMES, "Let me check both cities.\n", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Tokyo"})]),
    ("qwen", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "", [("f", {})]),
    ("llama3_json", LLAMA3, "", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("llama3_json", LLAMA3_TAG, "", [("search", {"query": 'sonar "pings"'})]),
    ("mistral", MISTRAL_V3, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", MISTRAL_V11, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("llama3_json", "The answer is {not json}.", "The answer is {not json}.", []),
    ("mistral", "Plain answer.", "Plain answer.", []),
    ("pythonic", PYTHONIC, "", [("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}), ("get_time", {}),
                                ("search", {"query": 'sonar "pings"', "filters": {"lang": ["en", None]}, "exact": True})]),
    ("pythonic", PYTHONIC_TAGS, "", [("module.lookup", {"key": -1500.0})]),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    ("pythonic", '[f("positional")]', '[f("positional")]', []),
    ("pythonic", "[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # not a literal: never evaluated
    ("pythonic", "[f(x=1e999)]", "[f(x=1e999)]", []),  # infinite: JSON cannot hold it
    ("pythonic", "[f(**{'a': 1})]", "[f(**{'a': 1})]", []),
]


def stream_in_pieces(parser_name: str, text: str, size: int) -> tuple[str, list]:
    stream = ToolCallStream(make_tool_parser(parser_name))
    events = []
    for start in range(0, len(text), size):
        events += stream.feed(text[start : start + size])
    events += stream.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [(e.call.name, json.loads(e.text)) for e in events if e.kind == "tool_call"]
    return content, calls


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_recorded_outputs(name: str, text: str, content: str, calls: list) -> None:
    result = make_tool_parser(name).extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert result.content.strip() == content.strip()
    assert len({c.id for c in result.tool_calls}) == len(calls)
    for size in (1, 3, 17, len(text)):
        streamed_content, streamed_calls = stream_in_pieces(name, text, size)
        assert streamed_calls == calls
        assert streamed_content.strip() == content.strip()


def test_streaming_sends_text_before_the_call_at_once() -> None:
    stream = ToolCallStream(make_tool_parser("hermes"))
    assert [e.text for e in stream.feed("Checking the weather")] == ["Checking the weather"]
    assert [e.text for e in stream.feed(" now <tool_")] == [" now "]  # '<tool_' may open a call: held
    assert stream.feed('call>{"name": "f", "arguments": {"x": 1}}') == []
    events = stream.feed("</tool_call>") + stream.finish()
    assert [(e.kind, e.call.name if e.call else None) for e in events] == [("tool_call", "f")]


ADVERSARIAL = {
    "nested brackets": "[" * 250_000 + "]" * 250_000,
    "nested objects": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "unclosed tag": "<tool_call>" + '{"name": "f", "arguments": {"x": "' + "y" * 500_000,
    "many unclosed tags": "<tool_call>{" * 45_000,
    "tag then brackets": "<tool_call>" + "{" * 500_000,
    "mistral brackets": "[TOOL_CALLS]" + "[" * 500_000,
    "mistral markers": "[TOOL_CALLS]x[ARGS]" * 25_000,
    "llama prefix": "<|python_tag|>" + "{" * 500_000,
    "semicolons": '{"name": "f", "parameters": {}};' * 5_000 + "{",
    "long sums": "[f(x=" + "1+" * 200_000 + "1)]",
    "deep call lists": "[f(x=" + "[" * 100_000 + "]" * 100_000 + ")]",
    "python start": "<|python_start|>" + "(" * 500_000,
}


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_outputs_finish_fast_as_content(parser_name: str, case: str) -> None:
    text = ADVERSARIAL[case]
    started = time.perf_counter()
    result = make_tool_parser(parser_name).extract(text)
    content, calls = stream_in_pieces(parser_name, text, 4096)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"{case} took {elapsed:.2f} s"
    assert result.tool_calls == [] and calls == []
    assert result.content == text and content == text


def test_required_and_named_outputs() -> None:
    tools = [ToolSpec("get_weather", None, {"type": "object"}), ToolSpec("get_time", None, {"type": "object"})]
    required = OutputParser(ToolPlan("required", tools), None, True)
    parsed = required.parse('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_time", {"zone": "UTC"})]
    assert required.parse('[{"name": "get_time", "param').tool_calls == []  # cut short: text
    named = OutputParser(ToolPlan("named", tools, named="get_weather"), None, True)
    events = named.feed('{"city": ') + named.feed('"Oslo"}') + named.finish()
    assert [e.kind for e in events] == ["tool_call", "arguments"]
    assert events[0].call.name == "get_weather" and "".join(e.text for e in events) == '{"city": "Oslo"}'
