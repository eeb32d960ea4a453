"""A server with API keys, a tiny waiting queue and a drain on SIGTERM."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess, metrics

KEYS = ["key-one", "key-two"]
# documented in docs/server.md: the routes that stay open when --api-key is set
OPEN_ROUTES = {
    "/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
    "/api/v1/info/version", "/api/extra/version",
}


@pytest.fixture(scope="module")
def guarded(tiny_model: str):
    process = ServerProcess([
        tiny_model, "--api-key", KEYS[0], "--api-key", KEYS[1], "--served-model-name", "tiny", "tiny-alias",
        "--max-num-seqs", "2", "--max-waiting-requests", "1", "--retry-after", "3", "--shutdown-timeout", "20",
        "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "256",
    ])
    yield process
    process.stop()


def _routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json").json()
    return [(method.upper(), path) for path, item in spec["paths"].items() for method in item]


def test_every_work_route_needs_a_key(guarded):
    routes = _routes(guarded.url)
    assert len(routes) >= 20
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for method, path in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "key-on"}):
                response = http.request(method, path, json={}, headers=headers)
                if path in OPEN_ROUTES:
                    assert response.status_code != 401, (method, path)
                else:
                    assert response.status_code == 401, (method, path, headers, response.status_code)
        for headers in ({"authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": KEYS[1]}):
            assert http.get("/v1/models", headers=headers).status_code == 200
    unauthorized = httpx.post(f"{guarded.url}/v1/messages", json={})
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{guarded.url}/v1/completions", json={}).json()["error"]["type"] == "authentication_error"
    for path in ("/docs", "/openapi.json", "/health", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200


def test_sdks_with_keys_and_model_aliases(guarded):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEYS[1], max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0).models.list()


def _long_stream(url: str, started: threading.Event, stop: threading.Event, result: dict) -> None:
    body = {"prompt": "Go", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"x-api-key": KEYS[0]}, timeout=60) as response:
        result["status"] = response.status_code
        text = ""
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                text += chunk["choices"][0]["text"]
                result["finish_reason"] = chunk["choices"][0]["finish_reason"]
                started.set()
                if stop.is_set():
                    return
        result["text"] = text


def test_full_queue_answers_503_with_retry_after(guarded):
    started = [threading.Event() for _ in range(3)]
    stop = threading.Event()
    results = [{} for _ in range(3)]
    threads = [threading.Thread(target=_long_stream, args=(guarded.url, started[i], stop, results[i])) for i in range(3)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while metrics(guarded.url).get("sonar:num_requests_in_flight", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        response = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"x-api-key": KEYS[0]})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        assert "busy" in response.json()["error"]["message"]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert [r.get("status") for r in results] == [200, 200, 200]
    deadline = time.monotonic() + 5
    while metrics(guarded.url).get("sonar:num_requests_in_flight", 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    ok = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"x-api-key": KEYS[0]})
    assert ok.status_code == 200


def test_sigterm_drains_running_requests_then_exits(guarded):
    started, stop, result = threading.Event(), threading.Event(), {}
    thread = threading.Thread(target=_long_stream, args=(guarded.url, started, stop, result))
    thread.start()
    assert started.wait(20)
    guarded.process.terminate()  # SIGTERM
    deadline = time.monotonic() + 5
    health = 200
    while health == 200 and time.monotonic() < deadline:
        health = httpx.get(f"{guarded.url}/health").status_code
        time.sleep(0.02)
    assert health == 503
    refused = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"x-api-key": KEYS[0]})
    assert refused.status_code == 503
    thread.join(30)
    assert result["finish_reason"] == "length"  # the running request finished, it was not cut off
    assert guarded.process.wait(20) == 0
