"""The KoboldAI surface over plain HTTP, as SillyTavern calls it."""

from __future__ import annotations

import json
import threading
import time

import httpx

from sonar import SamplingParams

PROMPT = "You are in a dark cave. You"


def greedy(oracle, max_tokens: int, **kwargs) -> str:
    return oracle.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs))[0].outputs[0].text


def sse_messages(response: httpx.Response) -> list[dict]:
    events, current = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            current = line[len("event: "):]
        elif line.startswith("data: "):
            events.append({"event": current, **json.loads(line[len("data: "):])})
    return events


def test_generate_greedy_equals_offline_llm(server, oracle):
    body = {"prompt": PROMPT, "max_length": 12, "temperature": 0, "rep_pen": 1.0, "top_p": 1, "top_k": 0,
            "typical": 1, "tfs": 1, "top_a": 0, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "sampler_seed": -1}
    response = httpx.post(f"{server.url}/api/v1/generate", json=body)
    assert response.status_code == 200
    result = response.json()["results"][0]
    assert result["text"] == greedy(oracle, 12)
    assert result["finish_reason"] == "length"


def test_kobold_names_map_onto_the_engine(server, oracle):
    body = {"prompt": PROMPT, "max_length": 8, "temperature": 0, "rep_pen": 1.3, "stop_sequence": []}
    text = httpx.post(f"{server.url}/api/v1/generate", json=body).json()["results"][0]["text"]
    assert text == greedy(oracle, 8, repetition_penalty=1.3)


def test_kobold_sampler_names_reach_the_engine(server, oracle):
    body = {"prompt": PROMPT, "max_length": 10, "temperature": 0, "rep_pen": 1.2, "rep_pen_range": 16,
            "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "nsigma": 1.5,
            "sampler_order": [6, 0, 1, 3, 4, 2, 5]}
    text = httpx.post(f"{server.url}/api/v1/generate", json=body).json()["results"][0]["text"]
    expected = greedy(oracle, 10, repetition_penalty=1.2, repetition_penalty_range=16, dry_multiplier=0.8,
                      dry_base=1.75, dry_allowed_length=2, nsigma=1.5)
    assert text == expected


def test_invalid_kobold_sampler_values_name_the_field(server):
    for field, value in [("typical", -0.5), ("rep_pen", 0), ("sampler_order", [9]), ("xtc_probability", 2.0)]:
        response = httpx.post(f"{server.url}/api/v1/generate", json={"prompt": PROMPT, "max_length": 4, field: value})
        assert response.status_code == 400, (field, response.text)
        assert field in response.text


def test_stream_sends_message_events(server, oracle):
    with httpx.stream("POST", f"{server.url}/api/extra/generate/stream", json={"prompt": PROMPT, "max_length": 12, "temperature": 0}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_messages(response)
    assert all(e["event"] == "message" for e in events)
    assert "".join(e["token"] for e in events) == greedy(oracle, 12)
    assert events[-1]["finish_reason"] == "length"


def test_abort_by_genkey_returns_partial_text(server):
    body = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "genkey": "KCPP-test-abort", "ban_eos_token": True}
    result = {}

    def run() -> None:
        result["response"] = httpx.post(f"{server.url}/api/v1/generate", json=body, timeout=60)

    worker = threading.Thread(target=run)
    worker.start()
    checked = ""
    deadline = time.monotonic() + 20
    while not checked and time.monotonic() < deadline:
        time.sleep(0.05)
        checked = httpx.post(f"{server.url}/api/extra/generate/check", json={"genkey": "KCPP-test-abort"}).json()["results"][0]["text"]
    assert checked, "the generation never showed progress"
    aborted = httpx.post(f"{server.url}/api/extra/abort", json={"genkey": "KCPP-test-abort"}).json()
    assert aborted["success"] == "true"
    worker.join(30)
    final = result["response"].json()["results"][0]
    assert final["finish_reason"] == "abort"
    assert final["text"].startswith(checked)


def test_check_and_abort_without_a_genkey_reach_only_unnamed_jobs(server):
    """On a server many clients share, a check or abort that names no genkey never reads or
    stops a generation whose client named its genkey; a single-user client that names none
    still reaches its own."""
    named = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "genkey": "KCPP-named", "ban_eos_token": True}
    unnamed = {k: v for k, v in named.items() if k != "genkey"}
    results: dict[str, httpx.Response] = {}

    def run(name: str, body: dict) -> None:
        results[name] = httpx.post(f"{server.url}/api/v1/generate", json=body, timeout=60)

    worker = threading.Thread(target=run, args=("named", named))
    worker.start()
    deadline = time.monotonic() + 20
    while not httpx.post(f"{server.url}/api/extra/generate/check", json={"genkey": "KCPP-named"}).json()["results"][0]["text"]:
        assert time.monotonic() < deadline, "the named generation never showed progress"
        time.sleep(0.05)
    assert httpx.post(f"{server.url}/api/extra/generate/check", json={}).json()["results"][0]["text"] == ""
    assert httpx.post(f"{server.url}/api/extra/abort", json={}).json()["success"] == "false"
    worker.join(30)
    assert results["named"].json()["results"][0]["finish_reason"] == "length"  # ran to its end

    worker = threading.Thread(target=run, args=("unnamed", unnamed))
    worker.start()
    deadline = time.monotonic() + 20
    while not httpx.post(f"{server.url}/api/extra/generate/check", json={}).json()["results"][0]["text"]:
        assert time.monotonic() < deadline, "the unnamed generation never showed progress"
        time.sleep(0.05)
    assert httpx.post(f"{server.url}/api/extra/abort", json={}).json()["success"] == "true"
    worker.join(30)
    assert results["unnamed"].json()["results"][0]["finish_reason"] == "abort"


def test_token_count_and_info_routes(server, oracle):
    count = httpx.post(f"{server.url}/api/extra/tokencount", json={"prompt": PROMPT}).json()
    assert count["value"] == len(oracle.get_tokenizer().encode(PROMPT)) == len(count["ids"])
    get = lambda path: httpx.get(f"{server.url}{path}").json()  # noqa: E731
    assert get("/api/v1/model") == {"result": "koboldcpp/tiny"}
    assert get("/api/v1/config/max_context_length") == {"value": 512}
    assert get("/api/extra/true_max_context_length") == {"value": 512}
    assert get("/api/v1/config/max_length")["value"] == 100
    assert get("/api/v1/info/version")["result"].count(".") == 2
    assert get("/api/extra/version")["result"] == "KoboldCpp"
