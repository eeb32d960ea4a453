"""The KoboldAI surface over plain HTTP, as SillyTavern calls it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

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


class Generation:
    """A blocking ``/api/v1/generate`` in a thread, watched through ``/api/extra/generate/check``.

    The tiny model writes its 400 tokens in about 0.3 s, so on a loaded machine a generation can
    end before a check reaches it; ``running`` says whether it was still going."""

    def __init__(self, server, body: dict) -> None:
        self.url = server.url
        self.response: httpx.Response | None = None
        self.worker = threading.Thread(target=self._run, args=(body,))
        self.worker.start()

    def _run(self, body: dict) -> None:
        self.response = httpx.post(f"{self.url}/api/v1/generate", json=body, timeout=60)

    def first_text(self, client: httpx.Client, check_body: dict) -> str:
        """The text a check shows once the generation has some; "" where it ended first."""
        deadline = time.monotonic() + 20
        while self.worker.is_alive():
            text = client.post(f"{self.url}/api/extra/generate/check", json=check_body).json()["results"][0]["text"]
            if text:
                return text
            assert time.monotonic() < deadline, "the generation never showed progress"
        return ""

    def result(self) -> dict:
        self.worker.join(30)
        assert self.response is not None and self.response.status_code == 200, self.response
        return self.response.json()["results"][0]


ATTEMPTS = 5
LONG = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "ban_eos_token": True}


def test_abort_by_genkey_returns_partial_text(server):
    body = {**LONG, "genkey": "KCPP-test-abort"}
    with httpx.Client() as client:
        for _ in range(ATTEMPTS):
            generation = Generation(server, body)
            checked = generation.first_text(client, {"genkey": "KCPP-test-abort"})
            aborted = client.post(f"{server.url}/api/extra/abort", json={"genkey": "KCPP-test-abort"}).json() if checked else None
            final = generation.result()
            if aborted and aborted["success"] == "true":
                break
            assert final["finish_reason"] == "length"  # it ended before the check or the abort reached it
        else:
            pytest.fail(f"{ATTEMPTS} generations ended before an abort reached them")
    assert final["finish_reason"] == "abort"
    assert final["text"].startswith(checked)


def test_check_and_abort_without_a_genkey_reach_only_unnamed_jobs(server):
    """On a server many clients share, a check or abort that names no genkey never reads or
    stops a generation whose client named its genkey; a single-user client that names none
    still reaches its own."""
    named = {**LONG, "genkey": "KCPP-named"}
    with httpx.Client() as client:
        check = lambda body: client.post(f"{server.url}/api/extra/generate/check", json=body).json()["results"][0]["text"]  # noqa: E731
        for _ in range(ATTEMPTS):
            generation = Generation(server, named)
            still_running = False
            if generation.first_text(client, {"genkey": "KCPP-named"}):
                unnamed_check = check({})
                unnamed_abort = client.post(f"{server.url}/api/extra/abort", json={}).json()["success"]
                still_running = check({"genkey": "KCPP-named"}) != ""
            final = generation.result()
            assert final["finish_reason"] == "length"  # never stopped by the unnamed abort
            if still_running:
                break
        else:
            pytest.fail(f"{ATTEMPTS} named generations ended before the unnamed check and abort were sent")
        assert unnamed_check == "" and unnamed_abort == "false"

        for _ in range(ATTEMPTS):
            generation = Generation(server, LONG)
            checked = generation.first_text(client, {})
            aborted = client.post(f"{server.url}/api/extra/abort", json={}).json() if checked else None
            final = generation.result()
            if aborted and aborted["success"] == "true":
                break
            assert final["finish_reason"] == "length"
        else:
            pytest.fail(f"{ATTEMPTS} unnamed generations ended before an abort reached them")
        assert final["finish_reason"] == "abort" and final["text"].startswith(checked)


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
