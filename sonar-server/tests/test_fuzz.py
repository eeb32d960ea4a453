"""Hostile bodies against the main routes of every API surface of a real server: wrong types,
nulls, huge and negative numbers, NaN and Infinity literals, deep nesting, unicode edge cases,
empty strings, missing and unknown fields, bodies that are not objects or not JSON. Every
answer is a 2xx or a 4xx in its API's error format, in time; afterwards the server serves a
normal request on each API, no request is left running and every KV block is free.

Deterministic (one seed); bounded by a request count and a deadline."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from conftest import metrics
from test_errors import anthropic_error, kobold_error, openai_error

SEED = 20261206
NUM_REQUESTS = 400
DEADLINE_S = 40.0  # the fuzz stops sending here even if requests remain (slow machines)
REQUEST_TIMEOUT_S = 30.0  # a hang fails the test

USER = [{"role": "user", "content": "Hi"}]
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {  # path -> (error format, a valid body)
    "/v1/completions": ("openai", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
    "/v1/chat/completions": ("openai", {"model": "tiny", "messages": USER, "max_tokens": 2}),
    "/tokenize": ("openai", {"model": "tiny", "prompt": "Hi"}),
    "/detokenize": ("openai", {"model": "tiny", "tokens": [1, 2]}),
    "/v1/messages": ("anthropic", {"model": "tiny", "messages": USER, "max_tokens": 2}),
    "/v1/messages/count_tokens": ("anthropic", {"model": "tiny", "messages": USER}),
    "/api/v1/generate": ("kobold", {"prompt": "Hi", "max_length": 2}),
    "/api/extra/generate/stream": ("kobold", {"prompt": "Hi", "max_length": 2}),
    "/api/extra/tokencount": ("kobold", {"prompt": "Hi"}),
    "/api/extra/generate/check": ("kobold", {"genkey": "KCPP1"}),
    "/api/extra/abort": ("kobold", {"genkey": "KCPP1"}),
}
ERROR_FORMATS = {"openai": openai_error, "anthropic": anthropic_error, "kobold": kobold_error}
BUDGET_FIELDS = {"max_tokens", "max_length"}  # never removed: a body without one generates to the context's end

FIELDS = {  # each API's own fields, and engine sampling fields any of them takes
    "openai": ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
               "logprobs", "top_logprobs", "echo", "stop", "logit_bias", "seed", "suffix", "response_format", "best_of", "tools", "tool_choice",
               "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "priority",
               "kv_transfer_params", "use_beam_search", "length_penalty", "vllm_xargs", "add_special_tokens", "tokens", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "prompt_logprobs"],
    "anthropic": ["model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata", "tools", "tool_choice"],
    "kobold": ["prompt", "max_length", "max_context_length", "n", "temperature", "top_k", "rep_pen", "rep_pen_range", "sampler_seed", "stop_sequence",
               "ban_eos_token", "trim_stop", "genkey", "grammar", "model", "typical", "tfs", "dry_multiplier", "dry_sequence_breakers",
               "dry_penalty_last_n", "mirostat", "dynatemp_range", "sampler_order", "banned_tokens", "logit_bias", "memory"],
    "engine": ["min_tokens", "top_k", "min_p", "stop_token_ids", "ignore_eos", "repetition_penalty", "truncate_prompt_tokens", "skip_special_tokens",
               "detokenize", "logits_processors", "output_kind", "guided_decoding", "bad_words", "bad_words_token_ids", "allowed_token_ids",
               "dry_base", "dry_allowed_length", "dry_sequence_breaker_ids", "xtc_threshold", "mirostat_tau", "typical_p", "eta_cutoff",
               "smoothing_factor", "dynatemp_min", "dynatemp_max", "no_repeat_ngram_size", "temperature_last", "sampler_priority", "extra_args"],
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
EDGES = {  # values valid in type but at an edge, per API: (field, value), or fields set together
    "openai": [
        {"use_beam_search": True, "n": 2, "length_penalty": 1e308}, {"use_beam_search": True, "n": 2, "length_penalty": -1e308},
        {"echo": True, "logprobs": 2, "prompt": [[7] * 50, "Hi"]}, {"stream": True, "stream_options": {"include_usage": True}, "n": 2, "logprobs": 1},
        ("prompt", [49151]), ("prompt", [49152]), ("prompt", [[1], [2]]), ("prompt", ["a", ""]), ("logprobs", 20), ("logprobs", 21),
        ("top_logprobs", 20), ("echo", True), ("n", 3), ("best_of", 3), ("use_beam_search", True), ("stream_options", {"include_usage": True}),
        ("response_format", {"type": "json_object"}), ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a+)+$"}}}),
        ("guided_regex", "(a|aa)*b"), ("guided_grammar", "root ::= root"), ("guided_choice", [""]), ("guided_json", {"type": "array", "minItems": 10**9}),
        ("guided_json", {"enum": []}), ("chat_template_kwargs", {"tokenize": True}), ("chat_template_kwargs", {"enable_thinking": True}),
        ("chat_template", "{{ raise_exception('no') }}"), ("continue_final_message", True), ("truncate_prompt_tokens", -1), ("min_tokens", 5),
        ("prompt_logprobs", 2), ("kv_transfer_params", {"do_remote_decode": True}), ("priority", 1), ("bad_words", ["a"]), ("allowed_token_ids", [2]),
        ("stop", ["i"]), ("dry_multiplier", 1.0), ("mirostat_mode", 2), ("no_repeat_ngram_size", 1), ("seed", 2**64 - 1), ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("model", ""),
    ],
    "anthropic": [
        ("system", [{"type": "text", "text": "s"}]), ("system", [{"type": "image"}]), ("stop_sequences", [""]), ("top_k", -1), ("tool_choice", {"type": "any"}),
        ("tool_choice", {"type": "tool", "name": "f"}), ("tool_choice", {"type": "auto", "disable_parallel_tool_use": "x"}),
        ("messages", [{"role": "assistant", "content": "prefill"}]), ("messages", [{"role": "user", "content": []}]),
        ("messages", [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]}]),
        ("messages", [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]}]),
        ("messages", [{"role": "user", "content": "Hi"}] * 600),
    ],
    "kobold": [
        ("sampler_order", [6, 0, 1, 3, 4, 2, 5]), ("sampler_order", [7]), ("dynatemp_range", 1), ("grammar", 'root ::= "a"'), ("grammar", "root ::= root"),
        ("genkey", ""), ("banned_tokens", "a"), ("stop_sequence", [""]), ("logit_bias", {"5": -100}), ("logit_bias", {"99999999": 1}),
        ("sampler_seed", -1), ("dry_penalty_last_n", -1), ("max_context_length", 1), ("n", 2), ("rep_pen_range", -1),
    ],
}


def _deep(depth: int, kind: str) -> str:
    return "[" * depth + "1" + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


RAW_VALUES = [  # JSON text, not Python values: NaN and Infinity literals, numbers past any float or integer, deep nesting
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "-0", "1e-400", _deep(200, "list"), _deep(200, "dict"), _deep(5000, "list"),
]
VALUES = [
    None, True, False, 0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e308, -1e308,
    "", "x", "0", "-1", "true", "null", "\x00", "\ud800", "\udfff\ud800", "🙂", "\u202e\u200b", "a" * 5000, "\n" * 100, "{{ 7*7 }}",
    "<|im_start|>", "</s>", "<tool_call>", [], [None], [1, "a"], [[[]]], [-1], [10**9], [0.5], ["x"], [""], [{}], [{"role": "user"}],
    {}, {"a": None}, {"": ""}, {"1": 1}, {"-1": 1}, {"type": None}, {"type": "json_schema"}, {"type": "function", "function": {"name": None}},
]


class Body:
    """A JSON body whose values may be raw JSON text (``RawValue``), written as is."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.raw: dict[str, str] = {}

    def set(self, key: str, value: Any, raw: str | None = None) -> None:
        if raw is None:
            self.value[key] = value
            return
        marker = f"@@raw-{len(self.raw)}@@"
        self.raw[json.dumps(marker)] = raw
        self.value[key] = marker

    def encode(self) -> bytes:
        text = json.dumps(self.value)
        for marker, raw in self.raw.items():
            text = text.replace(marker, raw)
        return text.encode()


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _mutated(rng: random.Random, api: str, valid: dict[str, Any]) -> Body:
    body = Body(_copy(valid))
    for _ in range(rng.choice([1, 1, 2, 3])):
        roll = rng.random()
        if roll < 0.1 and body.value:
            key = rng.choice(list(body.value))
            if key not in BUDGET_FIELDS:
                del body.value[key]
        elif roll < 0.25 and api != "kobold":
            message = {"role": rng.choice(["user", "assistant", "system", "tool", "developer", "wizard"]), "content": rng.choice(VALUES)}
            if rng.random() < 0.5:
                message["content"] = [{"type": rng.choice(["text", "image", "tool_use", "tool_result", "thinking"]), "text": rng.choice(VALUES),
                                       "input": rng.choice(VALUES), "name": rng.choice(VALUES), "tool_calls": rng.choice(VALUES)}]
            body.set("messages", [*USER, message] if rng.random() < 0.5 else [message])
        elif roll < 0.35 and api != "kobold":
            tool = _copy(TOOL)
            tool["function"][rng.choice(["name", "parameters", "description"])] = rng.choice(VALUES)
            if api == "anthropic":
                tool = {"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}
            body.set("tools", [tool])
            body.set("tool_choice", rng.choice([None, "auto", "required", "none", {"type": "auto"}, {"type": "any"}, rng.choice(VALUES)]))
        elif roll < 0.5:
            edge = rng.choice(EDGES[api])
            for field, value in (edge.items() if isinstance(edge, dict) else [edge]):
                body.set(field, _copy(value))
        elif roll < 0.6:
            body.set(rng.choice(FIELDS[api] + FIELDS["engine"]), None, raw=rng.choice(RAW_VALUES))
        else:
            body.set(rng.choice(FIELDS[api] + FIELDS["engine"]), rng.choice(VALUES))
    if rng.random() < 0.3:
        body.set("stream", True)
    return body


NOT_OBJECTS = [b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe", b'{"a":1,"a":2}', b"[" * 100_000, b"NaN", b'{"prompt": "Hi"} trailing']


def _request(index: int) -> tuple[str, str, bytes]:
    rng = random.Random(SEED * 1_000_003 + index)
    path = rng.choice(list(ROUTES))
    api, valid = ROUTES[path]
    content = rng.choice(NOT_OBJECTS) if rng.random() < 0.04 else _mutated(rng, api, valid).encode()
    return path, api, content


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in a response: not JSON")

    return json.loads(text, parse_constant=refuse)


def _problem(http: httpx.Client, index: int) -> str | None:
    """What is wrong with the answer to request ``index``, or None."""
    path, api, content = _request(index)
    where = f"#{index} POST {path} {content[:200]!r}"
    try:
        with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as response:
            text = response.read().decode()
    except httpx.HTTPError as exc:
        return f"{where}: no answer ({type(exc).__name__}: {exc})"
    status = response.status_code
    if not (200 <= status < 300 or 400 <= status < 500):
        return f"{where}: {status} {text[:300]}"
    if status >= 400:
        try:
            assert ERROR_FORMATS[api](response)
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            return f"{where}: {status} not in {api}'s error format ({exc!r}): {text[:300]}"
        return None
    if not response.headers["content-type"].startswith("text/event-stream"):
        _strict(text)
        return None
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    payloads = [_strict(event) for event in events if event != "[DONE]"]
    if any("error" in payload or payload.get("type") == "error" for payload in payloads if isinstance(payload, dict)):
        return f"{where}: an error event in a 200 stream: {text[-300:]}"
    ended = {"openai": events[-1:] == ["[DONE]"], "anthropic": payloads[-1:] == [{"type": "message_stop"}],
             "kobold": bool(payloads) and "finish_reason" in payloads[-1]}[api]  # fmt: skip
    return None if ended else f"{where}: the stream did not end: {text[-300:]}"


def test_hostile_bodies_get_a_2xx_or_a_4xx_in_their_apis_format_and_leave_nothing_behind(server):
    log_start = len(server.log())
    deadline = time.monotonic() + DEADLINE_S
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http, ThreadPoolExecutor(4) as pool:

        def check(index: int) -> str | None:
            return _problem(http, index) if time.monotonic() < deadline else None

        problems = [p for p in pool.map(check, range(NUM_REQUESTS)) if p]
    assert not problems, "\n".join(problems[:10])

    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/api/v1/generate"):
            response = http.post(path, json=ROUTES[path][1])
            assert response.status_code == 200, (path, response.text[:300])
    settle = time.monotonic() + 5.0
    while True:
        after = metrics(server.url)
        idle = (
            after["sonar:num_requests_running"] == after["sonar:num_requests_waiting"] == after["sonar:num_requests_in_flight"] == 0
            and after["sonar:num_kv_blocks_free"] == after["sonar:num_kv_blocks_total"]
        )
        if idle or time.monotonic() > settle:
            break
        time.sleep(0.05)
    assert idle, {k: v for k, v in after.items() if "blocks" in k or "requests_" in k}
    new_log = server.log()[log_start:]
    assert "Traceback" not in new_log and " failed" not in new_log, new_log[-3000:]


def test_the_fuzz_reaches_every_route_and_both_outcomes():
    """The seed's requests cover every route, and many are valid enough to be served."""
    requests = [_request(i) for i in range(NUM_REQUESTS)]
    assert {path for path, _, _ in requests} == set(ROUTES)
    assert sum(b"NaN" in content or b"Infinity" in content for _, _, content in requests) > 5
    assert sum(b'"stream": true' in content for _, _, content in requests) > 50
