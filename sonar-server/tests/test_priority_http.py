"""``--scheduling-policy priority`` over HTTP: a later request with a lower ``priority`` value
finishes before earlier ones; ``priority`` on an FCFS server is a 400."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess


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


async def _num_waiting(client: httpx.AsyncClient) -> float:
    """``sonar:num_requests_waiting``, read without blocking the event loop the requests run on."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("sonar:num_requests_waiting"):
            return float(line.rpartition(" ")[2])
    return 0.0


async def _one_scenario(url: str) -> list[str] | None:
    """One early request running (its tokens streaming), two more early ones and an urgent one
    waiting behind it: the finishing order, or None where the running one ended before all
    three were seen waiting (a slow host; the scenario then says nothing about priority)."""
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def send(name: str, priority: int, max_tokens: int) -> None:
            response = await client.post("/v1/completions", json=_body(priority, f"request {name}", max_tokens))
            assert response.status_code == 200, response.text
            finished.append(name)

        running = asyncio.get_running_loop().create_future()

        async def stream_the_running_one() -> None:
            body = {**_body(5, "request early0", 400), "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and not running.done():
                        running.set_result(None)  # its first token: it runs, alone (--max-num-seqs 1)
            finished.append("early0")

        first = asyncio.create_task(stream_the_running_one())
        await asyncio.wait([first, running], return_when=asyncio.FIRST_COMPLETED)
        others = [asyncio.create_task(send(f"early{i}", 5, 400)) for i in (1, 2)]
        others.append(asyncio.create_task(send("urgent", 0, 48)))
        # three waiting can only be seen while early0 runs: once it ends, one of them runs
        all_waiting = False
        while not finished and not all_waiting:
            all_waiting = await _num_waiting(client) >= 3
            await asyncio.sleep(0.01)
        await asyncio.gather(first, *others)
    return finished if all_waiting else None


def test_a_later_lower_priority_value_finishes_first(priority_server: ServerProcess) -> None:
    for _ in range(5):
        order = asyncio.run(_one_scenario(priority_server.url))
        if order is not None:
            break
    assert order is not None, "the running request always ended before the others queued"
    # early0 was running when the urgent one came; the other two early ones were waiting
    assert order[1] == "urgent", order


def test_priority_on_an_fcfs_server_is_a_400(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 3,
    })
    assert response.status_code == 400
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": "high"})
    assert bad.status_code == 400
