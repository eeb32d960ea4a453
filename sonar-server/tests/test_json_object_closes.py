"""``response_format: json_object`` cut by ``max_tokens`` still returns an object that parses
(``finish_reason`` stays ``length``), whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest
from sonar_server.json_closer import closing_suffix

WHOLE = '{"name": "Ann", "tags": ["a", "b\\"c"], "n": -12.5e3, "ok": true, "x": null, "o": {"k": [1, {}, []]}}'


def test_every_prefix_of_a_json_object_is_closed_into_valid_json() -> None:
    for end in range(1, len(WHOLE) + 1):
        prefix = WHOLE[:end]
        closed = prefix + closing_suffix(prefix)
        assert isinstance(json.loads(closed), dict), prefix
    assert closing_suffix(WHOLE) == ""
    assert closing_suffix('{"a": 1} trailing') is None and closing_suffix('{"a" 1') is None


@pytest.mark.parametrize("max_tokens", [3, 9])
def test_json_object_cut_by_max_tokens_parses(tools_client: openai.OpenAI, max_tokens: int) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": max_tokens, "temperature": 0, "response_format": {"type": "json_object"}}
    response = tools_client.chat.completions.create(**body)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == max_tokens
    content = response.choices[0].message.content
    assert isinstance(json.loads(content), dict)
    streamed, finish = "", None
    for chunk in tools_client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "length" and streamed == content


@pytest.mark.parametrize("max_tokens", [4, 9])
def test_json_object_completion_cut_by_max_tokens_parses(tools_client: openai.OpenAI, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": "A person as JSON:", "max_tokens": max_tokens, "temperature": 0}
    extra = {"response_format": {"type": "json_object"}}
    response = tools_client.completions.create(**body, extra_body=extra)
    assert response.choices[0].finish_reason == "length"
    text = response.choices[0].text
    assert isinstance(json.loads(text), dict)
    streamed, finish = "", None
    for chunk in tools_client.completions.create(**body, extra_body=extra, stream=True):
        for choice in chunk.choices:
            streamed += choice.text or ""
            finish = choice.finish_reason or finish
    assert finish == "length" and streamed == text
