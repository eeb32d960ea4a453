"""Every response body and SSE event is RFC 8259 JSON: no ``NaN``, ``Infinity`` or
``-Infinity``. A walk over every route ``/openapi.json`` lists (valid and bad requests,
streamed and not) on a model whose vocabulary is masked to three tokens, so logprobs of the
other tokens are ``-inf``; model texts holding ``NaN`` forced through the tool-call parsers;
and the helpers, unit by unit."""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx._decoders import LineDecoder
from sonar.outputs import Logprob
from sonar_server import strict_json
from sonar_server.parsers import ToolCallStream, make_tool_parser
from sonar_server.parsers.base import arguments_text
from sonar_server.strict_json import StrictJSONResponse, dumps_float_free, finite, finite_logprob
from sonar_server.streaming import sse_data, sse_event
from sonar_server.surfaces.openai.logprobs import chat_logprobs, completion_logprobs
from sonar_server.tool_calling import OutputParser, ToolPlan, ToolSpec, template_message_tool_calls

from conftest import KV_CACHE_BYTES, ServerProcess

PROMPT = "The quick brown fox"
LIVE_WORDS = (" the", " fox", " dog")  # the only tokens the masked model can produce
MESSAGES = [{"role": "user", "content": PROMPT}]
NOT_JSON_ROUTES = {("GET", "/metrics")}  # Prometheus text


def _refuse(constant: str) -> Any:
    raise AssertionError(f"{constant} in a response body: not JSON (RFC 8259)")


def strict_loads(text: str) -> Any:
    """What a strict client (JavaScript's JSON.parse, Go) accepts."""
    return json.loads(text, parse_constant=_refuse)


def json_body(response: httpx.Response) -> Any:
    assert response.headers["content-type"].startswith("application/json"), (response.request.url, response.headers["content-type"])
    return strict_loads(response.text)


def sse_payloads(response: httpx.Response) -> list[Any]:
    """Every ``data:`` payload of an event stream, each parsed strictly."""
    assert response.headers["content-type"].startswith("text/event-stream"), (response.request.url, response.text[:300])
    payloads = []
    for line in response.text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            payloads.append(strict_loads(line[5:].strip()))
    assert payloads, response.text[:300]
    return payloads


def floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [x for item in value.values() for x in floats(item)]
    if isinstance(value, list):
        return [x for item in value for x in floats(item)]
    return []


# -- a model whose logprobs are -inf for every token but three ------------------------------


def build_masked_model(source: str, folder: Path) -> list[int]:
    """A copy of the tiny llama whose logits are ``-inf`` for every token but ``LIVE_WORDS``:
    residual dimension 0 is a constant 100 (embeddings), untouched by the layers and kept
    positive by the final norm, and every other token's ``lm_head`` row is ``[-inf, 0, ...]``.
    Returns the live token ids."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    shutil.copytree(source, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    live = [tokenizer.encode(word, add_special_tokens=False).ids[0] for word in LIVE_WORDS]
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, 0] = 100.0
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[0, :] = 0.0  # [hidden, in]: no layer writes dimension 0
    weights["model.norm.weight"][0] = 1.0
    head = weights["lm_head.weight"]  # [vocab, hidden]
    kept = head[live].clone()
    kept[:, 0] = 0.0
    head.zero_()
    head[:, 0] = -math.inf
    head[live] = kept
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return live


@pytest.fixture(scope="module")
def masked_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("masked") / "model"
    build_masked_model(tiny_model, folder)
    process = ServerProcess([str(folder), "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512"])
    yield process
    process.stop()


# -- every route: a valid request (streamed too where it streams) and a bad one -------------


@dataclass
class Case:
    """How to call one route. ``valid`` is its body (None: no body); ``stream`` the body that
    makes it stream (its response is an event stream); ``bad`` a body it answers with a 4xx
    (None: call it with a method it does not allow); ``masked`` whether its responses carry
    logprobs of masked tokens, which must be ``-9999.0``."""

    valid: dict[str, Any] | None = None
    stream: dict[str, Any] | None = None
    bad: dict[str, Any] | str | None = None
    masked: bool = False
    streams_only: bool = False
    extra: list[dict[str, Any]] = field(default_factory=list)


COMPLETION = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "top_k": 1, "logprobs": 5, "echo": True}
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "top_k": 1, "logprobs": True, "top_logprobs": 5}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}
ANTHROPIC = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "temperature": 0, "top_k": 1}
KOBOLD = {"prompt": PROMPT, "max_length": 4, "top_k": 1}

CASES: dict[tuple[str, str], Case] = {
    ("GET", "/v1/models"): Case(),
    ("POST", "/v1/completions"): Case(
        COMPLETION,
        {**COMPLETION, "echo": False, **USAGE},
        {"model": "tiny", "prompt": PROMPT, "max_tokens": "four"},
        masked=True,
        extra=[{**COMPLETION, "prompt": [PROMPT, "Once upon"], "n": 2, "logprobs": 0}],
    ),
    ("POST", "/v1/chat/completions"): Case(CHAT, {**CHAT, **USAGE}, {**CHAT, "top_logprobs": 5, "logprobs": False}, masked=True),
    ("POST", "/tokenize"): Case({"model": "tiny", "prompt": PROMPT}, bad={"model": "tiny", "prompt": PROMPT, "messages": MESSAGES}),
    ("POST", "/detokenize"): Case({"model": "tiny", "tokens": [1, 2, 3]}, bad={"tokens": "one"}),
    ("POST", "/v1/messages"): Case(ANTHROPIC, {**ANTHROPIC, "stream": True}, {"model": "tiny", "messages": MESSAGES}),
    ("POST", "/v1/messages/count_tokens"): Case({"model": "tiny", "messages": MESSAGES}, bad={"model": "tiny", "messages": []}),
    ("POST", "/api/v1/generate"): Case(KOBOLD, bad={"max_length": 4}),
    ("POST", "/api/extra/generate/stream"): Case(stream=KOBOLD, bad={"prompt": PROMPT, "max_length": "x"}, streams_only=True),
    ("GET", "/api/extra/generate/check"): Case(),
    ("POST", "/api/extra/generate/check"): Case({"genkey": "KCPPnone"}, bad="{not json"),
    ("POST", "/api/extra/abort"): Case({"genkey": "KCPPnone"}, bad="[1, 2"),
    ("POST", "/api/extra/tokencount"): Case({"prompt": PROMPT}, bad={"text": PROMPT}),
    ("GET", "/api/v1/model"): Case(),
    ("GET", "/api/v1/config/max_context_length"): Case(),
    ("GET", "/api/v1/config/max_length"): Case(),
    ("GET", "/api/extra/true_max_context_length"): Case(),
    ("GET", "/api/v1/info/version"): Case(),
    ("GET", "/api/extra/version"): Case(),
    ("GET", "/health"): Case(),
    ("GET", "/ping"): Case(),
    ("POST", "/ping"): Case(),
    ("GET", "/version"): Case(),
}


def test_every_json_route_has_a_case(masked_server: ServerProcess) -> None:
    spec = json_body(httpx.get(f"{masked_server.url}/openapi.json"))
    routes = {(method.upper(), path) for path, item in spec["paths"].items() for method in item}
    assert routes - NOT_JSON_ROUTES - set(CASES) == set(), "a new route: add a Case for it above"
    assert set(CASES) - routes == set(), "a route is gone: remove its Case"


@pytest.mark.parametrize("route", list(CASES), ids=[f"{m} {p}" for m, p in CASES])
def test_route_bodies_and_events_are_strict_json(masked_server: ServerProcess, route: tuple[str, str]) -> None:
    method, path = route
    case = CASES[route]
    seen: list[Any] = []
    with httpx.Client(base_url=masked_server.url, timeout=120) as http:
        if not case.streams_only:
            for body in [case.valid, *case.extra]:
                response = http.request(method, path, json=body)
                assert response.status_code == 200, (route, response.text)
                seen.append(json_body(response))
        if case.stream is not None:
            response = http.request(method, path, json=case.stream)
            assert response.status_code == 200, (route, response.text)
            seen.extend(sse_payloads(response))
        if case.bad is None:
            bad = http.request("PUT", path)
            assert bad.status_code == 405, (route, bad.status_code)
        elif isinstance(case.bad, str):
            bad = http.request(method, path, content=case.bad, headers={"content-type": "application/json"})
        else:
            bad = http.request(method, path, json=case.bad)
        assert 400 <= bad.status_code < 500, (route, bad.status_code, bad.text)
        json_body(bad)
        if case.stream is not None and isinstance(case.bad, dict):
            streamed_bad = http.request(method, path, json={**case.bad, "stream": True})
            assert 400 <= streamed_bad.status_code < 500 and json_body(streamed_bad)
    if case.masked:  # the masked tokens' -inf logprobs, written as vLLM writes them
        assert min(floats(seen)) == -9999.0, route


def test_completion_logprobs_of_masked_tokens_are_minus_9999(masked_server: ServerProcess) -> None:
    body = json_body(httpx.post(f"{masked_server.url}/v1/completions", json=COMPLETION, timeout=60))
    logprobs = body["choices"][0]["logprobs"]
    num_prompt = len(logprobs["tokens"]) - 4
    assert logprobs["token_logprobs"][0] is None  # the first prompt token has nothing before it
    assert -9999.0 in logprobs["token_logprobs"][1:num_prompt]  # prompt words the model cannot write
    assert all(-9999.0 < v < 0 for v in logprobs["token_logprobs"][num_prompt:])  # generated: live tokens only
    for top in logprobs["top_logprobs"][num_prompt:]:
        assert len(top) == 5 and sorted(top.values())[:2] == [-9999.0, -9999.0]  # 3 live tokens, 2 masked


def test_chat_top_logprobs_of_masked_tokens_are_minus_9999(masked_server: ServerProcess) -> None:
    body = json_body(httpx.post(f"{masked_server.url}/v1/chat/completions", json=CHAT, timeout=60))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert -9999.0 < entry["logprob"] < 0
        assert [alt["logprob"] for alt in entry["top_logprobs"]][3:] == [-9999.0, -9999.0]


def test_unknown_routes_and_the_schema_are_strict_json(masked_server: ServerProcess) -> None:
    assert httpx.get(f"{masked_server.url}/v1/nope").status_code == 404
    json_body(httpx.get(f"{masked_server.url}/v1/nope"))
    assert json_body(httpx.get(f"{masked_server.url}/openapi.json"))["paths"]


# -- model texts with NaN / Infinity through the tool-call parsers (real server) ------------

TIME = {"type": "object", "properties": {"zone": {"type": "number"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]


def forced_call(number: str) -> str:
    return '<tool_call>\n{"name": "get_time", "arguments": {"zone": ' + number + "}}\n</tool_call>"


@pytest.mark.parametrize("number", NON_FINITE)
def test_openai_call_with_a_non_finite_number_stays_content(tools_url: str, number: str) -> None:
    forced = forced_call(number)
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "guided_choice": [forced]}
    message = json_body(httpx.post(f"{tools_url}/v1/chat/completions", json=body, timeout=60))["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == forced
    chunks = sse_payloads(httpx.post(f"{tools_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60))
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    assert not any("tool_calls" in delta for delta in deltas)
    assert "".join(delta.get("content") or "" for delta in deltas) == forced


@pytest.mark.parametrize("number", NON_FINITE)
def test_anthropic_call_with_a_non_finite_number_stays_text(tools_url: str, number: str) -> None:
    forced = forced_call(number)
    tools = [{"name": "get_time", "input_schema": TIME}]
    body = {"model": "tiny", "max_tokens": 60, "messages": MESSAGES, "tools": tools, "temperature": 0, "guided_choice": [forced]}
    message = json_body(httpx.post(f"{tools_url}/v1/messages", json=body, timeout=60))
    assert [(block["type"], block.get("text")) for block in message["content"]] == [("text", forced)]
    assert message["stop_reason"] == "end_turn"
    events = sse_payloads(httpx.post(f"{tools_url}/v1/messages", json={**body, "stream": True}, timeout=60))
    assert not any(event.get("content_block", {}).get("type") == "tool_use" for event in events)
    assert "".join(event["delta"].get("text", "") for event in events if event["type"] == "content_block_delta") == forced


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_grammar_forced_calls_with_top_logprobs_are_strict(tools_url: str, tool_choice: Any) -> None:
    body = {**CHAT, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 60}
    choice = json_body(httpx.post(f"{tools_url}/v1/chat/completions", json=body, timeout=60))["choices"][0]
    message = choice["message"]
    for call in message.get("tool_calls") or []:
        if choice["finish_reason"] != "length":  # a call cut by max_tokens carries its partial arguments
            assert isinstance(strict_loads(call["function"]["arguments"]), dict)
    chunks = sse_payloads(httpx.post(f"{tools_url}/v1/chat/completions", json={**body, **USAGE}, timeout=60))
    arguments = "".join(
        part["function"].get("arguments", "") for chunk in chunks for choice in chunk["choices"] for part in choice["delta"].get("tool_calls", [])
    )
    assert arguments == "".join(call["function"]["arguments"] for call in message.get("tool_calls") or [])


# -- the helpers ---------------------------------------------------------------------------


def test_finite_replaces_non_finite_floats_anywhere() -> None:
    nan, inf = float("nan"), float("inf")
    value = {"a": [1.5, nan, (inf, -inf, {"b": -inf})], "c": {"d": [[nan]]}, "e": "NaN", "f": True, "g": 3, "h": None, "i": -0.0}
    assert finite(value) == {"a": [1.5, None, [None, -9999.0, {"b": -9999.0}]], "c": {"d": [[None]]}, "e": "NaN", "f": True, "g": 3, "h": None, "i": -0.0}
    assert finite(-inf) == -9999.0 and finite(nan) is None and finite(inf) is None


def test_dumps_and_the_response_write_strict_json() -> None:
    value = {"logprob": float("-inf"), "top": [float("nan"), 2.5], "text": "héllo ✓"}
    text = strict_json.dumps(value)
    assert strict_loads(text) == {"logprob": -9999.0, "top": [None, 2.5], "text": "héllo ✓"}
    assert "\\u" not in text  # UTF-8 as is
    assert strict_json.dumps({"a": 1}) == '{"a":1}'
    assert strict_loads(StrictJSONResponse(value, status_code=400).body.decode()) == strict_loads(text)


def test_finite_logprob_follows_vllm() -> None:
    assert [finite_logprob(v) for v in (-0.25, 0.0, -12345.0, float("-inf"), float("nan"), float("inf"))] == [-0.25, 0.0, -9999.0, -9999.0, None, None]


@pytest.mark.parametrize("text", ['{"x": NaN}', '{"x": Infinity}', '[-Infinity]', '{"x": 1e999}', '{"x": -1e400}'])
def test_strict_loads_refuses_non_finite_numbers(text: str) -> None:
    with pytest.raises(ValueError):
        strict_json.loads(text)
    assert strict_json.loads('{"x": [1.5e10, -2, null]}') == {"x": [1.5e10, -2, None]}


def _logprob(value: float, token: str) -> Logprob:
    return Logprob(value, decoded_token=token)


def test_openai_logprob_formats_are_finite() -> None:
    entries = [{7: _logprob(-0.5, "a"), 8: _logprob(float("-inf"), "b"), 9: _logprob(float("nan"), "c")}, {8: _logprob(float("-inf"), "b")}]
    legacy = completion_logprobs(None, [7, 8], entries, 3, 0)  # type: ignore[arg-type]
    assert legacy["token_logprobs"] == [-0.5, -9999.0]
    assert sorted(legacy["top_logprobs"][0].items(), key=str) == [("a", -0.5), ("b", -9999.0), ("c", None)]
    chat = chat_logprobs(None, [7, 8], entries, 3)  # type: ignore[arg-type]
    assert [e["logprob"] for e in chat["content"]] == [-0.5, -9999.0]
    assert strict_loads(json.dumps(chat, allow_nan=False)) and strict_loads(json.dumps(legacy, allow_nan=False))


NAN_CALLS = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", 'Sure. <tool_call>{"name": "f", "arguments": {"x": [1, Infinity]}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": -Infinity}"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": Infinity}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": NaN}'),
]


@pytest.mark.parametrize("name, text", NAN_CALLS)
def test_a_call_holding_a_non_finite_number_is_no_call(name: str, text: str) -> None:
    result = make_tool_parser(name).extract(text)
    assert result.tool_calls == [] and result.content == text
    stream = ToolCallStream(make_tool_parser(name))
    events = stream.feed(text) + stream.finish()
    assert [e.kind for e in events if e.kind != "content"] == []
    assert "".join(e.text for e in events) == text


def test_finite_calls_still_parse_with_strict_arguments() -> None:
    result = make_tool_parser("hermes").extract('<tool_call>{"name": "f", "arguments": {"x": 1.5, "y": [-2e300]}}</tool_call>')
    assert [(c.name, strict_loads(c.arguments)) for c in result.tool_calls] == [("f", {"x": 1.5, "y": [-2e300]})]


def test_grammar_plans_and_helpers_refuse_non_finite_numbers() -> None:
    tools = [ToolSpec("f", None, {"type": "object"})]
    required = ToolPlan("required", tools)
    assert required.parse('[{"name": "f", "parameters": {"x": NaN}}]').tool_calls == []
    assert [c.arguments for c in required.parse('[{"name": "f", "parameters": {"x": 1}}]').tool_calls] == ['{"x": 1}']
    named = ToolPlan("named", tools, named="f")
    assert named.parse('{"x": Infinity}').tool_calls == [] and named.parse('{"x": Infinity}').content == '{"x": Infinity}'
    assert [c.arguments for c in named.parse('{"x": 2}').tool_calls] == ['{"x": 2}']
    parser = OutputParser(required, None, constrained=True)
    events = parser.feed('[{"name": "f", "parameters": {"x": -Infinity}}]') + parser.finish()
    assert [e.kind for e in events] == ["content"]
    assert arguments_text({"x": float("nan")}) is None and arguments_text('{"x": NaN}') is None and arguments_text('{"x": 1}') == '{"x": 1}'
    # a client's earlier call with NaN arguments reaches the template as the text it sent
    history = template_message_tool_calls([{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": NaN}'}}])
    assert history[0]["function"]["arguments"] == '{"x": NaN}'


def test_float_free_chunks_are_written_as_dumps_writes_them() -> None:
    """The stream's fast encoder writes the same bytes as ``dumps`` for payloads without floats:
    control characters, quotes, backslashes, line separators and astral characters included."""
    rng = random.Random(7)
    alphabet = [chr(i) for i in range(0x80)] + ["é", "\u2028", "\u2029", "😀", "\ufeff", "\u0085", "ー", "\ufffd"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        payload = {
            "id": "cmpl-1", "object": "text_completion", "created": 1_700_000_000, "model": "m/ü",
            "choices": [{"index": rng.randint(0, 3), "text": text, "logprobs": None, "finish_reason": rng.choice([None, "stop"]),
                         "stop_reason": rng.choice([None, 2, text]), "delta": {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}}],
            "usage": rng.choice([None, {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}]), "flag": rng.choice([True, False]),
        }
        assert dumps_float_free(payload) == strict_json.dumps(payload).encode("utf-8")
    # a float that gets in anyway still comes out as RFC 8259 JSON
    assert dumps_float_free({"a": float("nan"), "b": float("-inf"), "c": 0.5}) == b'{"a":null,"b":null,"c":0.5}'


def test_json_nested_past_the_parsers_depth_is_a_value_error() -> None:
    """Model text (a tool call's arguments) can nest as deep as its token budget allows; that
    is bad JSON to the parsers, not a crash."""
    for text in ("[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000):
        with pytest.raises(ValueError, match="nested too deeply"):
            strict_json.loads(text)
        with pytest.raises(ValueError, match="nested too deeply"):
            strict_json.raw_decode("call " + text, 5)


def test_events_stay_one_line_for_readers_that_split_on_unicode_line_breaks() -> None:
    """NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR go out as escapes: httpx's ``iter_lines``
    (str.splitlines' rules) would otherwise cut the event's JSON in two."""
    payload = {"choices": [{"text": "a\u2028b\u2029c\x85d é"}]}
    for event in (sse_data(payload).decode(), sse_data(payload, float_free=True).decode(), sse_event("message", payload).decode()):
        lines = [line for line in LineDecoder().decode(event) if line]
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1 and json.loads(data[0][6:]) == payload, event


def test_a_lone_surrogate_from_a_models_json_is_written_escaped() -> None:
    """A model's tool-call JSON with an unpaired ``\\ud800`` escape decodes to a string with
    no UTF-8 form: bodies and events keep it as its escape (the same JSON value) instead of
    failing to encode."""
    arguments = strict_json.loads('{"a": "x\\ud800y", "b": "é"}')
    payload = {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": arguments}}]}}], "logprob": float("-inf")}
    for encoded in (strict_json.dumps_utf8(payload), StrictJSONResponse(payload).body):
        assert json.loads(encoded) == {**payload, "logprob": -9999.0}
        assert b"\\ud800" in encoded
    for event in (sse_data(payload), sse_data({"text": arguments["a"]}, float_free=True), sse_event("message", payload)):
        data = event.decode("utf-8").split("data: ", 1)[1]
        assert json.loads(data)  # valid UTF-8, valid JSON


def test_large_responses_are_built_off_the_event_loop_with_the_same_bytes() -> None:
    import asyncio
    import threading

    content = {"logprobs": [float("-inf"), 0.5, float("nan")], "text": "caf\u00e9"}
    threads: list[str] = []

    def build() -> dict:
        threads.append(threading.current_thread().name)
        return content

    small = asyncio.run(strict_json.built_response(build, 10))
    large = asyncio.run(strict_json.built_response(build, strict_json.LARGE_RESPONSE_ENTRIES + 1))
    assert small.body == large.body == StrictJSONResponse(content).body
    assert large.headers["content-type"] == small.headers["content-type"]
    assert threads[0] == "MainThread" and threads[1] != "MainThread"


def test_a_large_logprobs_response_through_the_server(masked_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 130, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}
    reply = httpx.post(f"{masked_server.url}/v1/chat/completions", json=body, timeout=300).json()  # 8 x 130 x 21 entries: the worker-thread path
    assert sum(len(entry["top_logprobs"]) + 1 for choice in reply["choices"] for entry in choice["logprobs"]["content"]) > strict_json.LARGE_RESPONSE_ENTRIES
    assert all(len(choice["logprobs"]["content"]) == 130 for choice in reply["choices"]) and reply["usage"]["completion_tokens"] == 1040
