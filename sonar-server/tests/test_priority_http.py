"""``--scheduling-policy priority`` over HTTP: a later request with a lower ``priority`` value
finishes before earlier ones; ``priority`` on an FCFS server is a 400."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess, metrics


@pytest.fixture(scope="module")
def priority_server(tiny_model: str):
    process = ServerProcess(
        [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
         "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    )
    yield process
    process.stop()


def _body(priority: int, prompt: str, max_tokens: int = 48) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}


def test_a_later_lower_priority_value_finishes_first(priority_server: ServerProcess) -> None:
    url = priority_server.url

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def send(name: str, priority: int, max_tokens: int) -> None:
                response = await client.post("/v1/completions", json=_body(priority, f"request {name}", max_tokens))
                assert response.status_code == 200, response.text
                finished.append(name)

            # long enough that the running one is still running when the urgent one arrives
            # (with 48 tokens a slow host finished it first, and the next early one ran)
            early = [asyncio.create_task(send(f"early{i}", 5, 400)) for i in range(3)]
            deadline = time.monotonic() + 30
            while metrics(url).get("sonar:num_requests_waiting", 0) < 2:  # one runs, two wait
                assert time.monotonic() < deadline, "the early requests never queued"
                await asyncio.sleep(0.02)
            urgent = asyncio.create_task(send("urgent", 0, 48))
            await asyncio.gather(*early, urgent)
        return finished

    order = asyncio.run(run())
    # one early request was running when the urgent one came; the other two were waiting
    assert order[1] == "urgent", order


def test_priority_on_an_fcfs_server_is_a_400(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 3,
    })
    assert response.status_code == 400
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": "high"})
    assert bad.status_code == 400
