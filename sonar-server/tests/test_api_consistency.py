"""Results that must agree with each other and with the APIs' contracts: the sampled token
among its position's top logprobs, echoed prompts' logprobs the same streamed or not,
``prompt_logprobs`` returned, ``best_of`` refused, chat ``echo``, an Anthropic prefill
continued, and token counts that match what generation counts."""

from __future__ import annotations

import json

import httpx

from conftest import metrics

TOOL = {"type": "function", "function": {"name": "f", "description": "a tool", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}


def streamed(http: httpx.Client, path: str, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_completion_logprobs_hold_the_sampled_token_and_echo_streams_alike(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 12, "temperature": 1.5, "seed": 3, "logprobs": 2}
        logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
            assert token in top and len(top) <= 3

        body = {"model": "tiny", "prompt": "café naïve 日本語 🙂", "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        parts = [e["choices"][0] for e in streamed(http, "/v1/completions", body) if e["choices"]]
        assert "".join(p["text"] for p in parts) == whole["text"]
        joined = {key: [v for p in parts if p["logprobs"] for v in p["logprobs"][key]] for key in ("tokens", "token_logprobs", "text_offset")}
        assert joined == {key: whole["logprobs"][key] for key in joined}
        prompt_tokens = len(whole["logprobs"]["tokens"]) - 5
        assert whole["logprobs"]["text_offset"][prompt_tokens] == len(body["prompt"])  # the generated text starts after the echo
        assert whole["logprobs"]["token_logprobs"][0] is None


def test_prompt_logprobs_are_returned_and_best_of_is_refused(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        choice = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 1}).json()["choices"][0]
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) >= 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for entry in entries[1:] for v in entry.values())
        first = streamed(http, "/v1/completions", {"model": "tiny", "prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 1})[0]["choices"][0]
        assert first["prompt_logprobs"] == entries
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
        assert chat.json()["prompt_logprobs"][0] is None
        chat_stream = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                               "prompt_logprobs": 0, "stream": True})  # as vLLM: refused, not dropped
        assert chat_stream.status_code == 400 and chat_stream.json()["error"]["param"] == "prompt_logprobs"
        for extra in ({"best_of": 3}, {"n": 2, "best_of": 1}):
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, **extra})
            assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2}).status_code == 200


def test_continued_messages_echo_and_count_as_generated(server):
    """A prefilled assistant message is continued (Anthropic, and chat with
    continue_final_message), chat ``echo`` starts the reply with it, and /tokenize and
    count_tokens count what generation counts (tools included)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        chat = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "continue_final_message": True, "add_generation_prompt": False}
        continued = http.post("/v1/chat/completions", json=chat).json()
        anthropic = http.post("/v1/messages", json={"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}).json()
        assert anthropic["content"][0]["text"] == continued["choices"][0]["message"]["content"]
        assert anthropic["usage"]["input_tokens"] == continued["usage"]["prompt_tokens"]

        echoed = http.post("/v1/chat/completions", json={**chat, "echo": True}).json()["choices"][0]["message"]["content"]
        assert echoed == "The answer is" + continued["choices"][0]["message"]["content"]
        first = streamed(http, "/v1/chat/completions", {**chat, "echo": True})[0]["choices"][0]["delta"]
        assert first["content"] == "The answer is"

        tokenized = http.post("/tokenize", json={"model": "tiny", "messages": messages, "continue_final_message": True, "add_generation_prompt": False})
        assert tokenized.json()["count"] == continued["usage"]["prompt_tokens"]
        with_tools = {"model": "tiny", "messages": messages[:1], "max_tokens": 2, "tools": [TOOL]}
        usage = http.post("/v1/chat/completions", json=with_tools).json()["usage"]
        assert http.post("/tokenize", json={"model": "tiny", "messages": messages[:1], "tools": [TOOL]}).json()["count"] == usage["prompt_tokens"]

        tools = [{"name": "f", "description": "a tool", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}]
        body = {"model": "tiny", "messages": messages[:1], "tools": tools}
        message = http.post("/v1/messages", json={**body, "max_tokens": 2}).json()
        assert http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"] == message["usage"]["input_tokens"]


def test_a_command_line_chat_template_and_no_docs(tiny_model, tmp_path):
    """``--chat-template FILE`` renders every chat prompt; ``--disable-fastapi-docs`` takes
    /docs and /openapi.json away."""
    from conftest import KV_CACHE_BYTES, ServerProcess

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    process = ServerProcess([tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
                             "--chat-template", str(template), "--disable-fastapi-docs"])  # fmt: skip
    try:
        with httpx.Client(base_url=process.url, timeout=60) as http:
            ids = http.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
            assert http.post("/detokenize", json={"model": "tiny", "tokens": ids}).json()["prompt"] == "[user] hi\n[assistant] "
            assert http.get("/docs").status_code == 404 and http.get("/openapi.json").status_code == 404
    finally:
        process.stop()


def test_truncate_prompt_tokens_counts_the_kept_tokens(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "word " * 600, "max_tokens": 2, "truncate_prompt_tokens": 50}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == 50


def test_browsers_get_cors_headers_as_from_vllm(server):
    """Any origin may call the API from a browser by default (vLLM's default), preflight included."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        preflight = http.options("/v1/chat/completions", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                                                 "Access-Control-Request-Headers": "content-type,authorization"})  # fmt: skip
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "https://app.example")
        response = http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert response.headers["access-control-allow-origin"] == "*"


def test_beam_search_through_the_api_equals_the_offline_beams(server, oracle):
    """vLLM's ``use_beam_search``: ``n`` beams, best first, the same as ``LLM.beam_search``."""
    from sonar import BeamSearchParams

    tokenizer = oracle.get_tokenizer()
    prompt = "The river flows"
    ids = tokenizer.encode(prompt)
    offline = oracle.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0].sequences
    want = [tokenizer.decode(beam.tokens[len(ids):], skip_special_tokens=True) for beam in offline]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body).json()
        assert [choice["text"] for choice in reply["choices"]] == want
        assert reply["usage"]["completion_tokens"] == 15 and all(c["finish_reason"] == "length" for c in reply["choices"])
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                                                        "use_beam_search": True, "ignore_eos": True}).json()
        assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 8
        for extra, param in (({"stream": True}, "stream"), ({"n": 11}, "n")):
            response = http.post("/v1/completions", json={**body, **extra})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_beam_search_counts_as_one_request_in_the_metrics(server):
    """However many engine requests its steps make, a beam search is one finished request of
    its API in /metrics, with its prompt and generated tokens and one end-to-end latency."""
    before = metrics(server.url)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "The river flows", "max_tokens": 5, "n": 3,
                                                         "use_beam_search": True, "ignore_eos": True}).json()  # fmt: skip
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                                                        "use_beam_search": True, "ignore_eos": True}).json()  # fmt: skip
    after = metrics(server.url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    labels = 'api="{api}",finished_reason="length",model_name="tiny"'
    assert delta(f"sonar:request_success_total{{{labels.format(api='openai.completions')}}}") == 1
    assert delta(f"sonar:request_success_total{{{labels.format(api='openai.chat')}}}") == 1
    assert delta("sonar:request_success_total") == 2
    assert delta("sonar:e2e_request_latency_seconds_count") == 2
    usage = [completion["usage"], chat["usage"]]
    assert delta("sonar:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("sonar:generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 15 + 8
