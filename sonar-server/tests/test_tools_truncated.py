"""A tool call cut off by ``max_tokens`` comes back as a call with its partial arguments and
``finish_reason: "length"`` (Anthropic: ``stop_reason: "max_tokens"``), never as plain text."""

from __future__ import annotations

import anthropic
import openai
import pytest
from sonar_server.parsers.partial import partial_call, partial_call_list, with_cut_call
from sonar_server.parsers.tools import HermesToolParser
from test_tools_api import ANTHROPIC_TOOLS, MESSAGES, TOOLS, streamed_calls


def test_partial_calls_are_read_from_cut_json() -> None:
    cut = partial_call('{"name": "get_weather", "arguments": {"city": "Par')
    assert (cut.name, cut.arguments) == ("get_weather", '{"city": "Par')
    assert partial_call('{"name": "get_wea') is None
    assert partial_call('{"name": "get_wea', ("get_weather", "get_time")).name == "get_weather"  # the one name a grammar allowed
    assert partial_call('{"name": "get_', ("get_weather", "get_time")) is None
    calls = partial_call_list('[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":')
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", '{"y":')]
    parser = HermesToolParser()
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zo'
    result = with_cut_call(parser, parser.extract(text))
    assert result.content == "Sure. " and [(c.name, c.arguments) for c in result.tool_calls] == [("get_time", '{"zo')]


@pytest.mark.parametrize(("choice", "max_tokens"), [("named", 4), ("required", 24)])
def test_openai_forced_call_cut_by_max_tokens(tools_client: openai.OpenAI, choice: str, max_tokens: int) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": max_tokens, "temperature": 0}
    response = tools_client.chat.completions.create(**body)
    choice_out = response.choices[0]
    assert choice_out.finish_reason == "length" and choice_out.message.content is None
    (call,) = choice_out.message.tool_calls
    assert call.id and call.function.name in {"get_weather", "get_time"}
    assert choice == "required" or (call.function.name == "get_weather" and call.function.arguments.startswith("{"))
    calls, content, finish = streamed_calls(tools_client.chat.completions.create(**body, stream=True))
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]


def test_openai_auto_call_cut_by_max_tokens(tools_client: openai.OpenAI) -> None:
    forced = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "extra_body": {"guided_choice": [forced]}}
    whole = tools_client.chat.completions.create(**body, max_tokens=80).usage.completion_tokens
    body["max_tokens"] = whole - 3  # cut inside the call's closing
    response = tools_client.chat.completions.create(**body)
    (call,) = response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "length" and call.function.name == "get_time"
    assert forced.startswith(f'<tool_call>\n{{"name": "get_time", "arguments": {call.function.arguments}')
    calls, _, finish = streamed_calls(tools_client.chat.completions.create(**body, stream=True))
    assert finish == "length" and [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]


def test_anthropic_forced_tool_use_cut_by_max_tokens(tools_url: str) -> None:
    claude = anthropic.Anthropic(base_url=tools_url, api_key="unused", max_retries=0)
    body = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}
    message = claude.messages.create(**body, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"] and message.content[0].name == "get_weather"
