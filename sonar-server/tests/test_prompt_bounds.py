"""A prompt far longer than the context in characters is refused from its head alone on the
generating routes (``encode_within_context``), never one that fits; the counting routes and
Kobold's trimming still read every token."""

from __future__ import annotations

import httpx
import pytest

from sonar_server.errors import ApiError
from sonar_server.prompts import HEAD_CHARS_PER_TOKEN, HEAD_SLACK_TOKENS, encode_within_context


def counting(tokens_per_char: float):
    calls: list[int] = []

    def encode(text: str) -> list[int]:
        calls.append(len(text))
        return [7] * int(len(text) * tokens_per_char)

    return encode, calls


def test_the_head_decides_only_a_prompt_that_cannot_fit():
    context = 100
    head = HEAD_CHARS_PER_TOKEN * (context + HEAD_SLACK_TOKENS)
    encode, calls = counting(0.5)  # dense: the head alone is past the context
    with pytest.raises(ApiError, match="the prompt is more than 100 tokens"):
        encode_within_context(encode, "x" * (2 * head + 1), context, "prompt")
    assert calls == [head]  # the rest was never tokenized
    encode, calls = counting(0.5)  # as long, but at most twice the head: tokenized whole (the engine refuses it)
    assert len(encode_within_context(encode, "x" * (2 * head), context, "prompt")) == head
    assert calls == [2 * head]
    encode, calls = counting(0.001)  # sparse: its head fits, so the whole prompt is tokenized
    assert len(encode_within_context(encode, "x" * (3 * head), context, "prompt")) == int(3 * head * 0.001)
    assert calls == [head, 3 * head]


def test_counting_routes_read_every_token_of_a_long_text(server):
    text = "word " * 4000  # past twice the head of a 512-token context, 4,001 tokens
    with httpx.Client(base_url=server.url, timeout=60) as http:
        count = http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()["count"]
        assert count > 4000
        assert http.post("/api/extra/tokencount", json={"prompt": text}).json()["value"] == count
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
        assert refused.status_code == 400 and "the prompt is more than 512 tokens" in refused.text
