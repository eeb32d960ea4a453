"""Bad requests get a 4xx in their API's error format, and the next good request succeeds."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest


def escaped(body: dict) -> bytes:
    """``body`` as ASCII JSON: a lone surrogate goes out as its ``\\uXXXX`` escape (no UTF-8 holds it)."""
    return json.dumps(body).encode()


LONG_PROMPT = "word " * 2000  # far more than the 512-token context
TEN_MB = b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'


def openai_error(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == response.status_code
    return error["message"]


def anthropic_error(response: httpx.Response) -> str:
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"].endswith("_error") or body["error"]["type"] == "request_too_large"
    return body["error"]["message"]


def kobold_error(response: httpx.Response) -> str:
    detail = response.json()["detail"]
    assert set(detail) == {"msg", "type"}
    return detail["msg"]


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
KOBOLD = {"prompt": "Hello", "max_length": 2}

# (path, good body, error parser, [(case, body or raw bytes, expected status)])
CASES = [
    ("/v1/completions", COMPLETION, openai_error, [
        ("wrong type", {**COMPLETION, "max_tokens": "many"}, 400),
        ("prompt type", {**COMPLETION, "prompt": {"text": 1}}, 400),
        ("negative max_tokens", {**COMPLETION, "max_tokens": -5}, 400),
        ("huge max_tokens", {**COMPLETION, "max_tokens": 10**9}, 400),
        ("huge n", {**COMPLETION, "n": 10**6}, 400),
        ("unknown model", {**COMPLETION, "model": "gpt-17"}, 404),
        ("empty prompt list", {**COMPLETION, "prompt": []}, 400),
        ("prompt longer than the context", {**COMPLETION, "prompt": LONG_PROMPT}, 400),
        ("out-of-vocabulary token id", {**COMPLETION, "prompt": [10**9]}, 400),
        ("token ids as booleans", {**COMPLETION, "prompt": [True, False]}, 400),
        ("token ids as floats", {**COMPLETION, "prompt": [1.5, 2.0]}, 400),
        ("ids and text mixed", {**COMPLETION, "prompt": [[1, 2], "text"]}, 400),
        ("bad sampling field", {**COMPLETION, "top_p": 7}, 400),
        ("malformed JSON", b'{"prompt": "Hel', 400),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe\xfd"}', 400),
        ("lone surrogate escape", escaped({**COMPLETION, "prompt": "Hel\ud800lo"}), 400),
        ("lone surrogate in a stop string", escaped({**COMPLETION, "stop": ["\udc00"]}), 400),
        ("engine field of the wrong type", {**COMPLETION, "skip_special_tokens": {"a": 1}}, 400),
        ("stop of the wrong type", {**COMPLETION, "stop_token_ids": 7}, 400),
        ("logit_bias values not numbers", {**COMPLETION, "logit_bias": {"5": []}}, 400),
        ("guided_choice a string, not a list", {**COMPLETION, "guided_choice": "yes"}, 400),
        ("guided_json the schema false", {**COMPLETION, "guided_json": False}, 400),
        ("beam search with a NaN length_penalty", b'{"prompt": "Hi", "max_tokens": 2, "use_beam_search": true, "n": 2, "length_penalty": NaN}', 400),
        ("10 MB body", TEN_MB, 413),
    ]),
    ("/v1/chat/completions", CHAT, openai_error, [
        ("empty messages", {**CHAT, "messages": []}, 400),
        ("wrong role", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("huge n", {**CHAT, "n": 10**6}, 400),
        ("unknown model", {**CHAT, "model": "gpt-17"}, 404),
        ("prompt longer than the context", {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400),
        ("huge max_tokens", {**CHAT, "max_completion_tokens": 10**9}, 400),
        ("lone surrogate escape", escaped({**CHAT, "messages": [{"role": "user", "content": "\udbff"}]}), 400),
        ("engine field of the wrong type", {**CHAT, "ignore_eos": "yes"}, 400),
        ("malformed JSON", b"[[[", 400),
        ("more messages than the context holds", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 20000}, 400),
        ("tool call not an object", {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [1]}, *CHAT["messages"]]}, 400),
        ("tool call function not an object", {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": [1, 2]}]}, *CHAT["messages"]]}, 400),
        ("tool calls not a list", {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": "f"}, *CHAT["messages"]]}, 400),
    ]),
    ("/v1/messages", MESSAGES, anthropic_error, [
        ("missing max_tokens", {k: v for k, v in MESSAGES.items() if k != "max_tokens"}, 400),
        ("negative max_tokens", {**MESSAGES, "max_tokens": -1}, 400),
        ("huge max_tokens", {**MESSAGES, "max_tokens": 10**9}, 400),
        ("empty messages", {**MESSAGES, "messages": []}, 400),
        ("unknown model", {**MESSAGES, "model": "claude-99"}, 404),
        ("image block", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ("prompt longer than the context", {**MESSAGES, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400),
        ("malformed JSON", b'{"model":', 400),
        ("more messages than the context holds", {**MESSAGES, "messages": [{"role": "user", "content": "a"}] * 20000}, 400),
        ("invalid UTF-8", b'{"model": "\xc3\x28"}', 400),
        ("lone surrogate escape", escaped({**MESSAGES, "system": "\ud800"}), 400),
        ("tool_result content not text", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]}, 400),
        ("text block without text", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400),
        ("system text block without text", {**MESSAGES, "system": [{"type": "text", "text": 5}]}, 400),
        ("tool_use input not an object", {**MESSAGES, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, 400),
        ("tool_use without a name", {**MESSAGES, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]}, 400),
        ("tool_result content a list of strings", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": ["x"]}]}]}, 400),
        ("tool_choice any without tools", {**MESSAGES, "tool_choice": {"type": "any"}}, 400),
        ("tool_choice naming a tool without tools", {**MESSAGES, "tool_choice": {"type": "tool", "name": "nope"}}, 400),
        ("tool_choice without a type", {**MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {}}, 400),
        ("10 MB body", TEN_MB, 413),
    ]),
    ("/api/v1/generate", KOBOLD, kobold_error, [
        ("wrong type", {**KOBOLD, "max_length": [1]}, 400),
        ("negative max_length", {**KOBOLD, "max_length": -3}, 400),
        ("huge max_length", {**KOBOLD, "max_length": 10**9}, 400),
        ("huge n", {**KOBOLD, "n": 10**6}, 400),
        ("genkey of 100,000 characters", {**KOBOLD, "genkey": "k" * 100000}, 400),
        # a prompt longer than the context is cut to fit, as KoboldCpp does (test_kobold_context.py)
        ("no room beside max_length in max_context_length", {**KOBOLD, "max_context_length": 2}, 400),
        ("lone surrogate escape", escaped({**KOBOLD, "prompt": "\ud800"}), 400),
        ("engine field of the wrong type", {**KOBOLD, "skip_special_tokens": []}, 400),
        ("malformed JSON", b"{prompt: Hello}", 400),
        ("logit_bias value past any float", b'{"prompt": "Hello", "max_length": 2, "logit_bias": {"5": %s}}' % (b"1" + b"0" * 400), 400),
        ("dynatemp_range past any float", b'{"prompt": "Hello", "max_length": 2, "dynatemp_range": %s}' % (b"1" + b"0" * 400), 400),
        ("10 MB body", TEN_MB, 413),
    ]),
]


@pytest.mark.parametrize("path, good, parse_error, cases", CASES, ids=[c[0] for c in CASES])
def test_bad_requests_get_4xx_in_the_api_format(server, path, good, parse_error, cases):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for case, body, status in cases:
            if isinstance(body, bytes):
                response = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            assert response.status_code == status, f"{case}: {response.status_code} {response.text[:300]}"
            assert parse_error(response), f"{case}: empty error message"
            assert http.post(path, json=good).status_code == 200, f"a good request after {case!r} failed"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_token_counting_refuses_lone_surrogates(server):
    """The tokenizing endpoints, which run no generation, answer a lone surrogate with a 400 too."""
    for path, body, parse_error in (
        ("/tokenize", {"prompt": "a\ud800"}, openai_error),
        ("/v1/messages/count_tokens", {**MESSAGES, "messages": [{"role": "user", "content": "\ud800"}]}, anthropic_error),
        ("/api/extra/tokencount", {"prompt": "\ud800"}, kobold_error),
    ):
        response = httpx.post(f"{server.url}{path}", content=escaped(body), headers={"content-type": "application/json"})
        assert response.status_code == 400 and "surrogate" in parse_error(response), (path, response.text[:300])
    emoji = httpx.post(f"{server.url}/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"})
    assert emoji.status_code == 200  # an escaped pair is one character, not a lone surrogate


def test_error_messages_say_what_was_wrong(server):
    response = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "max_tokens": 10**9})
    message = openai_error(response)
    assert "max_tokens=1000000000" in message and "512" in message
    response = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "n": 10**6})
    assert "n=1000000" in openai_error(response)
    response = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "model": "gpt-17"})
    assert "'tiny'" in openai_error(response)


def test_sdks_raise_their_own_error_types(server):
    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=10**9)
    anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model="tiny", messages=[], max_tokens=1)


def test_curl_style_body_without_json_content_type_is_accepted(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text


def test_edge_values_that_are_valid_are_served(server):
    """The largest seed with n > 1 (the later choices' seeds wrap around), the JSON schema
    ``true`` (any JSON value) and beam search with a length penalty of +-1e308 are served."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/completions", json={**COMPLETION, "seed": 2**64 - 1, "n": 2, "temperature": 1.0})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
        response = http.post("/v1/completions", json={**COMPLETION, "guided_json": True, "max_tokens": 4})
        assert response.status_code == 200, response.text
        for penalty in (1e308, -1e308):  # beam search whose length penalty leaves the floats (was a 500)
            response = http.post("/v1/chat/completions", json={**CHAT, "use_beam_search": True, "n": 2, "length_penalty": penalty})
            assert response.status_code == 200 and len(response.json()["choices"]) == 2, response.text


def test_a_client_gone_while_sending_its_body_is_not_a_server_error(server):
    """A client that closes its connection halfway through its body is not logged as a
    failure (nothing reads the answer), and the server goes on serving."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    assert "ClientDisconnect" not in server.log()


@pytest.mark.parametrize(("path", "error_of"), [
    ("/v1/completions", lambda body: body["error"]["message"]),
    ("/v1/messages", lambda body: body["error"]["message"] if body["type"] == "error" else None),
    ("/api/v1/generate", lambda body: body["detail"]["msg"]),
])
def test_a_body_that_trickles_in_gets_408_and_its_connection_closed(server, path, error_of):
    """A client that sends its headers and part of its body, then nothing: 408 in the API's
    format once --request-read-timeout has passed, the connection closed, the server serving."""
    import socket
    from urllib.parse import urlparse

    from conftest import BODY_TIMEOUT_S

    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.settimeout(BODY_TIMEOUT_S + 20)
        started = time.monotonic()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"prompt": ')
        received = b""
        while chunk := sock.recv(65536):  # read until the server closes the connection
            received += chunk
        waited = time.monotonic() - started
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    assert BODY_TIMEOUT_S - 0.5 <= waited <= BODY_TIMEOUT_S + 15, waited
    assert "did not arrive within" in error_of(json.loads(body)), body
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200


@pytest.mark.parametrize("first_bytes", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_headers_that_never_finish_get_408_and_the_connection_closed(server, first_bytes):
    """A connection that sends nothing, or a request line and a header and then nothing: 408
    once --request-read-timeout has passed, and the connection closed (uvicorn alone keeps it)."""
    import socket
    from urllib.parse import urlparse

    from conftest import BODY_TIMEOUT_S

    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.settimeout(BODY_TIMEOUT_S + 20)
        started = time.monotonic()
        sock.sendall(first_bytes)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        waited = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408"), received[:300]
    assert b"headers did not arrive in time" in received
    assert BODY_TIMEOUT_S - 0.5 <= waited <= BODY_TIMEOUT_S + 15, waited
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30).status_code == 200


def test_a_keep_alive_connection_outlives_the_header_limit(server):
    """Three requests on one connection, 0.6 x the limit apart, so the connection lives past
    --request-read-timeout: each is answered (the header limit counts from each request's first
    byte, not from the connection), and the connection stays open between them."""
    import socket
    from urllib.parse import urlparse

    from conftest import BODY_TIMEOUT_S

    url = urlparse(server.url)
    body = json.dumps(COMPLETION).encode()
    request = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.settimeout(30)
        for turn in range(3):
            if turn:
                time.sleep(0.6 * BODY_TIMEOUT_S)  # under uvicorn's 5 s keep-alive
            sock.sendall(request)
            received = b""
            while b"\r\n\r\n" not in received:
                received += sock.recv(65536)
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += sock.recv(65536)
            assert json.loads(rest[:length])["choices"], rest
    assert time.monotonic() - started > BODY_TIMEOUT_S  # the connection outlived the limit


def test_a_huge_bad_words_list_is_refused_at_once_while_other_streams_go_on(server):
    """200,000 bad words (which took the server 11 s to tokenize, with pauses of 0.7 s in every
    other stream) are a 400 naming the limit within a second or two, in each API's format; a
    bad word past the token limit is a 400 naming it; a stream running meanwhile gets every
    token, and the next request is served."""
    import threading
    import time

    words = [f"w{i}" for i in range(200_000)]
    streamed: list[dict] = []

    def stream() -> None:
        body = {**COMPLETION, "max_tokens": 64, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            streamed.extend(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))

    streaming = threading.Thread(target=stream)
    streaming.start()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, parse_error, field in (
            ("/v1/completions", {**COMPLETION, "bad_words": words}, openai_error, "bad_words"),
            ("/v1/chat/completions", {**CHAT, "bad_words": words}, openai_error, "bad_words"),
            ("/api/v1/generate", {**KOBOLD, "banned_tokens": words}, kobold_error, "banned_tokens (bad_words)"),
        ):
            started = time.monotonic()
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, response.text[:300])
            assert f"{field} takes at most 1024 strings, got 200000" in parse_error(response)
            assert time.monotonic() - started < 2.0
        response = http.post("/v1/completions", json={**COMPLETION, "bad_words": ["fine", "xq" * 100]})
        assert response.status_code == 400 and "a bad word may be at most 64 tokens" in openai_error(response)
        assert http.post("/v1/completions", json={**COMPLETION, "bad_words": ["fine"] * 1024}).status_code == 200
    streaming.join(60)
    assert streamed[-1]["usage"]["completion_tokens"] == 64
    assert [c["finish_reason"] for event in streamed for c in event["choices"] if c["finish_reason"]] == ["length"]


def _tool(number: int) -> dict:
    return {"type": "function", "function": {"name": f"f{number}", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}


def test_oversized_lists_are_refused_by_their_count_while_other_streams_go_on(server):
    """Lists and maps past what the model or the server can use are a 400 naming the limit
    within a second or two, in each API's format, before anything walks them (a 2,000,000-entry
    allowed_token_ids paused every other stream 0.3 s, 20,000 tools 4.3 s, a prompt of a
    million floats 10 s, a prompt of five megabytes 5 s to tokenize); a stream running meanwhile
    gets every token, and lists as long as the model allows are served."""
    import threading
    import time

    streamed: list[dict] = []

    def stream() -> None:
        body = {**COMPLETION, "max_tokens": 64, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            streamed.extend(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))

    many_ids, wide_map = [5] * 2_000_000, {str(i): 1.0 for i in range(100_000)}
    user = {"role": "user", "content": "a"}
    huge = "word " * 1_000_000
    cases = [
        ("/v1/completions", {**COMPLETION, "allowed_token_ids": many_ids}, openai_error, "allowed_token_ids has 2000000 entries; the model's vocabulary has 49152 tokens"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": many_ids}, openai_error, "stop_token_ids has 2000000 entries"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": wide_map}, openai_error, "logit_bias has 100000 entries"),
        ("/v1/messages", {**MESSAGES, "dry_sequence_breaker_ids": many_ids}, anthropic_error, "dry_sequence_breaker_ids has 2000000 entries"),
        ("/api/v1/generate", {**KOBOLD, "logit_bias": wide_map}, kobold_error, "logit_bias has 100000 entries"),
        ("/api/v1/generate", {**KOBOLD, "sampler_order": [1] * 1_000_000}, kobold_error, "sampler_order takes at most 64 ids, got 1000000"),
        ("/v1/completions", {**COMPLETION, "sampler_priority": [1] * 1_000_000}, openai_error, "sampler_priority lists 1000000 stages"),
        ("/v1/completions", {**COMPLETION, "extra_args": {f"k{i}": i for i in range(100_000)}}, openai_error, "extra_args takes at most 256 keys"),
        ("/v1/chat/completions", {**CHAT, "tools": [_tool(i) for i in range(20_000)]}, openai_error, "at most 128 tools, got 20000"),
        ("/v1/messages", {**MESSAGES, "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(200)]}, anthropic_error, "at most 128 tools, got 200"),
        ("/v1/chat/completions", {**CHAT, "messages": [user] * 100_000}, openai_error, "100000 messages cannot fit in the model's context of 512 tokens"),
        ("/v1/messages", {**MESSAGES, "messages": [user] * 100_000}, anthropic_error, "100000 messages cannot fit in the model's context of 512 tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}, openai_error, "100000 content parts cannot fit"),
        ("/v1/completions", {**COMPLETION, "prompt": [[5]] * 500_000}, openai_error, "500000 prompts are more than this server runs at once"),
        ("/v1/completions", {**COMPLETION, "prompt": [1.5] * 1_000_000}, openai_error, "prompt"),
        ("/detokenize", {"tokens": many_ids}, openai_error, "2000000 token ids cannot fit in the model's context of 512 tokens"),
        ("/v1/completions", {**COMPLETION, "guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60_000)}}}, openai_error, "holds more than 100000 values"),
        # a prompt of megabytes (five seconds of a core to tokenize) is refused once its head is past the context
        ("/v1/completions", {**COMPLETION, "prompt": huge}, openai_error, "the prompt is more than 512 tokens"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}, openai_error, "the prompt is more than 512 tokens"),
        ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": huge}]}, anthropic_error, "the prompt is more than 512 tokens"),
    ]
    streaming = threading.Thread(target=stream)
    streaming.start()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, parse_error, expected in cases:
            started = time.monotonic()
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, expected, response.text[:300])
            assert expected in parse_error(response), (path, response.text[:300])
            assert time.monotonic() - started < 3.0, (path, expected)
        # as long as the model allows: the whole vocabulary; repeats count once
        for allowed in (list(range(49152)), [5, 5, 7] * 1000):
            response = http.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": allowed, "logit_bias": {"5": 1.0, "05": 2.0}})
            assert response.status_code == 200, response.text[:300]
        response = http.post("/v1/chat/completions", json={**CHAT, "tools": [_tool(i) for i in range(128)], "tool_choice": "none"})
        assert response.status_code == 200, response.text[:300]
    streaming.join(60)
    assert streamed[-1]["usage"]["completion_tokens"] == 64
    assert [c["finish_reason"] for event in streamed for c in event["choices"] if c["finish_reason"]] == ["length"]


def test_bodies_that_cannot_be_read_are_named_plainly(server):
    """Bodies that are not a JSON object, or that Python's parser gives up on, and template
    variables that would override the renderer's own arguments, get a 400 saying so in the
    API's words (not "There was an error parsing the body" or a Python signature)."""
    cases = [
        ("/v1/completions", b"[1, 2]", openai_error, "the request body must be a JSON object"),
        ("/v1/messages", b"", anthropic_error, "the request body must be a JSON object"),
        ("/api/v1/generate", b"[" * 100_000, kobold_error, "the body is not valid JSON (it nests deeper than this server reads)"),
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ' + b"1" * 5000 + b"}", openai_error, "a number in it has more digits than this server reads"),
        ("/v1/chat/completions", json.dumps({**CHAT, "chat_template_kwargs": {"tokenize": True, "messages": []}}).encode(), openai_error,
         "chat_template_kwargs may not set messages, tokenize"),
        ("/v1/completions", json.dumps({**COMPLETION, "prompt": [["x"]] * 300}).encode(), openai_error,
         "prompt: 300 prompts are more than this server runs at once (256, --max-num-seqs)"),
    ]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, content, parse_error, expected in cases:
            response = http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400, (path, content[:60], response.text[:300])
            message = parse_error(response)
            assert message.startswith(expected) if expected.startswith("prompt") else expected in message, (path, message)
            assert "Value error" not in message and "function-before" not in message
