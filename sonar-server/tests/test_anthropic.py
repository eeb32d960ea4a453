"""The Anthropic surface through the official ``anthropic`` SDK, against the offline LLM."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from sonar import SamplingParams

SYSTEM = "You are a pirate."
MESSAGES = [{"role": "user", "content": "Where is the treasure?"}]
# this SDK version sends temperature/top_p/top_k only as extra body fields
GREEDY = {"temperature": 0}
CHAT = [{"role": "system", "content": SYSTEM}, *MESSAGES]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def offline(oracle, max_tokens: int = 10, **kwargs):
    return oracle.chat(CHAT, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs))[0].outputs[0]


def test_message_greedy_equals_offline_chat(client, oracle):
    expected = offline(oracle)
    message = client.messages.create(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY)
    assert message.content[0].type == "text"
    assert message.content[0].text == expected.text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 10
    assert message.usage.input_tokens == len(oracle.apply_chat_template(CHAT))


def test_text_blocks_and_top_k(client, oracle):
    message = client.messages.create(
        model="tiny", system=[{"type": "text", "text": SYSTEM}], max_tokens=10, extra_body={"temperature": 1.0, "top_k": 1},
        messages=[{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}],
    )
    assert message.content[0].text == offline(oracle).text


def test_stream_events_in_order_with_the_same_text(client, oracle):
    expected = offline(oracle)
    with client.messages.stream(model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[0] == "message_start"
    assert kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert final.content[0].text == expected.text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_stop_sequence(client, oracle):
    full = offline(oracle, 16).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    message = client.messages.create(
        model="tiny", system=SYSTEM, messages=MESSAGES, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert message.content[0].text == full[: full.index(stop)]
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop


def test_count_tokens(client, oracle):
    count = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == len(oracle.apply_chat_template(CHAT))


def test_anthropic_version_header_is_accepted(server):
    response = httpx.post(
        f"{server.url}/v1/messages",
        headers={"anthropic-version": "2023-06-01", "x-api-key": "whatever"},
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
    )
    assert response.status_code == 200
    assert response.json()["type"] == "message"
