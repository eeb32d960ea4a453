"""32 concurrent streaming clients, a quarter of them disconnecting mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from conftest import metrics

NUM_CLIENTS = 32


def _request(index: int, leaves: bool) -> tuple[str, dict]:
    # leavers ask for far more tokens than they read: only an abort frees their slots early
    max_tokens = 400 if leaves else 24
    api = index % 3
    if api == 0:
        return "/v1/completions", {"prompt": f"Story number {index}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    if api == 1:
        return "/v1/messages", {
            "model": "tiny", "messages": [{"role": "user", "content": f"Tell story {index}"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        }
    return "/api/extra/generate/stream", {"prompt": f"Story number {index}:", "max_length": max_tokens, "ignore_eos": True}


async def _client(http: httpx.AsyncClient, index: int, leaves: bool) -> int:
    path, body = _request(index, leaves)
    num_events = 0
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            num_events += 1
            payload = line[len("data: "):]
            if payload != "[DONE]":
                assert "error" not in json.loads(payload)
            if leaves and num_events == 3:
                return num_events  # leaving the block closes the connection mid-stream
    return num_events


def test_disconnecting_clients_are_aborted_and_free_their_blocks(server):
    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(_client(http, i, leaves=i % 4 == 0) for i in range(NUM_CLIENTS)))

    before = metrics(server.url)
    num_events = asyncio.run(main())
    finished_at = time.monotonic()
    stayers = [n for i, n in enumerate(num_events) if i % 4 != 0]
    assert len(stayers) == 24 and min(stayers) >= 10  # every remaining client got its whole stream

    while True:
        after = metrics(server.url)
        idle = (
            after["sonar:num_requests_running"] == 0
            and after["sonar:num_requests_waiting"] == 0
            and after["sonar:num_requests_in_flight"] == 0
            and after["sonar:num_kv_blocks_free"] == after["sonar:num_kv_blocks_total"]
        )
        if idle or time.monotonic() - finished_at > 2.0:
            break
        time.sleep(0.05)
    assert idle, {k: v for k, v in after.items() if "blocks" in k or "requests_" in k}
    num_finished = after.get("sonar:request_success_total", 0) - before.get("sonar:request_success_total", 0)
    assert num_finished == NUM_CLIENTS

    def num_aborted(values: dict[str, float]) -> float:
        return sum(v for k, v in values.items() if k.startswith("sonar:request_success_total{") and 'finished_reason="abort"' in k)

    assert num_aborted(after) - num_aborted(before) == NUM_CLIENTS // 4
    # the leavers were cut short: far fewer tokens than 8 x 400 were generated
    generated = after["sonar:generation_tokens_total"] - before.get("sonar:generation_tokens_total", 0)
    assert generated < 24 * 24 + 8 * 200


def test_non_streaming_client_that_gives_up_is_aborted(server):
    before = metrics(server.url)
    body = {"prompt": "A very long tale:", "max_length": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/api/v1/generate", json=body, timeout=0.1)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        after = metrics(server.url)
        if after["sonar:num_requests_in_flight"] == 0 and after["sonar:num_kv_blocks_free"] == after["sonar:num_kv_blocks_total"]:
            break
        time.sleep(0.05)
    assert after["sonar:num_requests_in_flight"] == 0
    assert after["sonar:num_kv_blocks_free"] == after["sonar:num_kv_blocks_total"]
    assert after["sonar:generation_tokens_total"] - before["sonar:generation_tokens_total"] < 450


def test_a_client_leaving_a_non_streaming_request_is_no_server_error(server):
    """The request is aborted and its blocks freed, and the server logs no failure for it:
    nobody is there to read an answer (499, as proxies record it)."""

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.1) as http:
            with contextlib.suppress(httpx.TimeoutException):
                await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True})

    log_before = server.log()
    asyncio.run(leave())
    deadline = time.monotonic() + 10
    while metrics(server.url)["sonar:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(server.url)["sonar:num_requests_running"] == 0
    new_log = server.log()[len(log_before):]
    assert "finish=abort" in new_log and "Traceback" not in new_log and "failed" not in new_log, new_log[-2000:]
