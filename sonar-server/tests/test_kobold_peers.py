"""Kobold's check and abort across API servers: the channel the API servers of one ``sonar
serve`` ask each other on, and the Kobold routes over it with a real engine."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from conftest import KV_CACHE_BYTES
from sonar_server.peers import ApiServerPeers, PeerAnswer, PeerQuestion, peer_address

PROMPT = "Once upon a time"


def _run(coroutine):
    return asyncio.run(coroutine)


async def _peers(ipc_dir: str, count: int) -> list[ApiServerPeers]:
    """``count`` peers, started, once each reaches every other (a peer not connected yet is
    left out of a question, as one that is gone)."""
    peers = [ApiServerPeers(ipc_dir, i, count) for i in range(count)]
    for peer in peers:
        await peer.start()
        peer.handle("ping", lambda key: PeerAnswer(found=True))
    await _connected(peers)
    return peers


async def _connected(peers: list[ApiServerPeers]) -> None:
    deadline = time.monotonic() + 10
    for peer in peers:
        while len(await peer.ask("ping", timeout=0.5)) < peer.count - 1:
            assert time.monotonic() < deadline, "the peers never connected"
            await asyncio.sleep(0.01)


def test_each_peer_answers_from_its_own_handler_and_the_asker_hears_all_that_hold_something():
    async def main() -> None:
        with tempfile.TemporaryDirectory() as ipc_dir:
            peers = await _peers(ipc_dir, 3)
            try:
                held = {0: {"a": "text of a"}, 1: {}, 2: {"c": "text of c"}}
                for i, peer in enumerate(peers):
                    peer.handle("check", lambda key, i=i: PeerAnswer(found=key in held[i], text=held[i].get(key, "")))
                assert [a.text for a in await peers[1].ask("check", "a")] == ["text of a"]
                assert [a.text for a in await peers[0].ask("check", "c")] == ["text of c"]
                assert await peers[0].ask("check", "a") == []  # its own jobs are not asked of the others
                assert await peers[2].ask("no such op", "a") == []
                answers = await asyncio.gather(*(peers[1].ask("check", key) for key in ["a", "c"] * 20))
                assert [[a.text for a in found] for found in answers] == [["text of a"], ["text of c"]] * 20
            finally:
                for peer in peers:
                    await peer.close()

    _run(main())


def test_a_single_api_server_asks_nobody():
    async def main() -> None:
        peer = ApiServerPeers("", 0, 1)
        await peer.start()
        started = time.monotonic()
        assert await peer.ask("check", "a") == []
        assert time.monotonic() - started < 0.05
        await peer.close()

    _run(main())


def test_a_peer_that_is_gone_is_left_out():
    async def main() -> None:
        with tempfile.TemporaryDirectory() as ipc_dir:
            peers = await _peers(ipc_dir, 3)
            peers[1].handle("check", lambda key: PeerAnswer(found=True, text="from 1"))
            await peers[2].close()
            try:
                started = time.monotonic()
                assert [a.text for a in await peers[0].ask("check", "x", timeout=0.3)] == ["from 1"]
                assert time.monotonic() - started < 2.0  # at once once its going is seen, else after the timeout
                await asyncio.sleep(0.2)
                started = time.monotonic()
                assert [a.text for a in await peers[0].ask("check", "x", timeout=5)] == ["from 1"]
                assert time.monotonic() - started < 1.0  # no waiting on a peer whose socket is closed
            finally:
                await peers[0].close()
                await peers[1].close()

    _run(main())


def test_garbage_and_pickles_on_a_peer_socket_run_no_code_and_it_answers_on(tmp_path: Path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    async def main() -> None:
        with tempfile.TemporaryDirectory() as ipc_dir:
            peers = await _peers(ipc_dir, 2)
            peers[1].handle("check", lambda key: PeerAnswer(found=key == "k", text="ok"))
            context = zmq.asyncio.Context()
            try:
                attacker = context.socket(zmq.DEALER)
                attacker.connect(peer_address(ipc_dir, 1))
                for frames in (
                    [pickle.dumps(Exploit())], [b"\xc1\xff"], [b""], [b"a", b"b", b"c"],
                    [msgspec.msgpack.encode({"id": 1, "op": "check", "key": "k", "extra": pickle.dumps(Exploit())})],
                    [msgspec.msgpack.encode({"id": "1", "op": "check"})], [msgspec.msgpack.encode([1, 2, 3])],
                ):  # fmt: skip
                    await attacker.send_multipart(frames)
                await attacker.send(msgspec.msgpack.encode(PeerQuestion(7, "check", "k")))
                reply = msgspec.msgpack.decode(await asyncio.wait_for(attacker.recv(), 5), type=PeerAnswer)
                assert reply.id == 7 and reply.found and reply.text == "ok"  # the only frame that decoded got its answer
                # and an answer frame that does not decode, sent back at an asker, is dropped
                assert [a.text for a in await peers[0].ask("check", "k")] == ["ok"]
                attacker.close(linger=0)
            finally:
                context.destroy(linger=0)
                for peer in peers:
                    await peer.close()

    _run(main())
    assert not marker.exists()


@pytest.fixture(scope="module")
def two_api_servers(tiny_model: str):
    """Two API servers' apps (each its own ServerState and peer channel) over one engine, as
    two processes of ``sonar serve --api-server-count 2`` share the engine cores."""
    from sonar import LLM
    from sonar.engine.async_client import AsyncLLM
    from sonar_server.app import build_app
    from sonar_server.settings import ServerSettings
    from sonar_server.state import ServerState

    llm = LLM(tiny_model, kv_cache_memory_bytes=int(KV_CACHE_BYTES), max_model_len=512)
    client = AsyncLLM(llm.llm_engine)
    ipc_dir = tempfile.mkdtemp(prefix="sonar-peers-")
    settings = ServerSettings(served_model_names=["tiny"], api_server_count=2)
    states = [ServerState(client, settings, i, ipc_dir) for i in range(2)]
    apps = [build_app(state) for state in states]
    yield apps, states, client
    client.shutdown()
    shutil.rmtree(ipc_dir, ignore_errors=True)


async def _start_peers(states) -> None:
    for state in states:
        await state.peers.start()
        state.peers.handle("ping", lambda key: PeerAnswer(found=True))
    await _connected([state.peers for state in states])


async def _close_peers(states) -> None:
    for state in states:
        await state.peers.close()


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sonar", timeout=60)


async def _first_text(http: httpx.AsyncClient, body: dict) -> str:
    """Check (``body``: a genkey or none) through ``http`` until the generation shows text."""
    deadline = time.monotonic() + 20
    while True:
        text = (await http.post("/api/extra/generate/check", json=body)).json()["results"][0]["text"]
        if text:
            return text
        assert time.monotonic() < deadline, "the generation never showed progress through the other API server"
        await asyncio.sleep(0.02)


def test_check_abort_and_genkey_clashes_reach_the_api_server_that_runs_the_generation(two_api_servers):
    apps, states, _ = two_api_servers
    body = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "genkey": "KCPP-peer", "ban_eos_token": True}

    async def main() -> None:
        await _start_peers(states)
        try:
            async with _http(apps[0]) as owner, _http(apps[1]) as other:
                running = asyncio.create_task(owner.post("/api/v1/generate", json=body))
                checked = await _first_text(other, {"genkey": "KCPP-peer"})
                clash = await other.post("/api/v1/generate", json=body)
                assert clash.status_code == 400 and "already generating" in clash.json()["detail"]["msg"]
                assert (await other.post("/api/extra/generate/check", json={"genkey": "KCPP-nobody"})).json()["results"][0]["text"] == ""
                assert (await other.post("/api/extra/generate/check", json={})).json()["results"][0]["text"] == ""  # named: not reached unnamed
                assert (await other.post("/api/extra/abort", json={})).json()["success"] == "false"
                aborted = (await other.post("/api/extra/abort", json={"genkey": "KCPP-peer"})).json()
                assert aborted["success"] == "true"
                final = (await running).json()["results"][0]
                assert final["finish_reason"] == "abort" and final["text"].startswith(checked)
                assert (await other.post("/api/extra/abort", json={"genkey": "KCPP-peer"})).json()["success"] == "false"  # gone
        finally:
            await _close_peers(states)

    _run(main())


def test_unnamed_jobs_are_reached_through_the_other_api_server_and_two_are_not_read(two_api_servers):
    apps, states, _ = two_api_servers
    body = {"prompt": PROMPT, "max_length": 400, "temperature": 0, "ban_eos_token": True}

    async def main() -> None:
        await _start_peers(states)
        try:
            async with _http(apps[0]) as first, _http(apps[1]) as second:
                running = asyncio.create_task(first.post("/api/v1/generate", json=body))
                await _first_text(second, {})
                also = asyncio.create_task(second.post("/api/v1/generate", json=body))  # one unnamed job on each server
                deadline = time.monotonic() + 20
                while not any(states[1].surface_data.get("kobold", {})):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                assert (await first.post("/api/extra/generate/check", json={})).json()["results"][0]["text"] == ""  # two: whose?
                assert (await first.post("/api/extra/abort", json={})).json()["success"] == "true"  # stops both
                results = [(await task).json()["results"][0] for task in (running, also)]
                assert [r["finish_reason"] for r in results] == ["abort", "abort"]
        finally:
            await _close_peers(states)

    _run(main())
