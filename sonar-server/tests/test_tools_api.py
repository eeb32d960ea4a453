"""Tool calling and reasoning through the official ``openai`` and ``anthropic`` SDKs, with a
tiny random model: grammars make its calls well-formed, forced texts exercise the parsers."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[dict[int, dict], str, str | None]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or part.id
                if part.function is not None:
                    entry["name"] += part.function.name or ""
                    entry["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, content, finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_openai_forced_tool_calls(tools_client: openai.OpenAI, choice: str) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    response = tools_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=120, temperature=0
    )
    message = response.choices[0].message
    check_calls(message.tool_calls, {"get_weather"} if choice == "named" else None)
    assert message.content is None and response.choices[0].finish_reason == "tool_calls"

    stream = tools_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True
    )
    calls, content, finish = streamed_calls(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments) for t in message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_openai_auto_tool_choice_parses_the_models_text(tools_client: openai.OpenAI) -> None:
    forced = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": {"guided_choice": [forced]}}
    message = tools_client.chat.completions.create(**body).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_time", {"zone": "CET"})]
    calls, _, finish = streamed_calls(tools_client.chat.completions.create(**body, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "CET"})]
    assert finish == "tool_calls"
    # a model that writes plain text gets plain content
    plain = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_openai_tools_alone_mean_auto_without_any_flag(server) -> None:
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    forced = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    response = plain.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0, extra_body={"guided_choice": [forced]})
    assert [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls] == [("get_time", {"zone": "UTC"})]
    assert response.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    response = plain.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    check_calls(response.choices[0].message.tool_calls, {"get_time"})


def test_openai_tool_conversation_and_errors(tools_client: openai.OpenAI, tools_url: str) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    assert tools_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4).choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="already constrains"):
        tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})


def test_openai_reasoning_content(tools_client: openai.OpenAI) -> None:
    forced = "<think>The user wants weather.</think>It is sunny."
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "extra_body": {"guided_choice": [forced]}}
    message = tools_client.chat.completions.create(**body).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants weather." and message.content == "It is sunny."
    reasoning, content = "", ""
    for chunk in tools_client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("The user wants weather.", "It is sunny.")


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "Time in a zone", "input_schema": TIME},
]


@pytest.fixture(scope="module")
def claude(tools_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}])
def test_anthropic_tool_use_blocks(claude: anthropic.Anthropic, tool_choice: dict) -> None:
    body = {"model": "tiny", "max_tokens": 120, "messages": MESSAGES, "tools": ANTHROPIC_TOOLS, "tool_choice": tool_choice, "extra_body": {"temperature": 0}}
    message = claude.messages.create(**body)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]


def test_anthropic_thinking_and_tool_history(claude: anthropic.Anthropic, tools_url: str) -> None:
    forced = "<think>Short plan.</think>Hello there."
    body = {"model": "tiny", "max_tokens": 60, "messages": MESSAGES, "extra_body": {"guided_choice": [forced], "temperature": 0}}
    message = claude.messages.create(**body)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [("thinking", "Short plan."), ("text", "Hello there.")]
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Short plan."
    history = MESSAGES + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}]},
    ]
    reply = claude.messages.create(model="tiny", max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert reply.content[0].type == "text"
    bad = httpx.post(f"{tools_url}/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
