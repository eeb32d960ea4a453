"""Prefill/decode disaggregation with the NixlConnector: a prefill server and a decode server
whose engines move KV blocks over NIXL (UCX between two host processes), and ``sonar proxy``,
all real processes on loopback, against one server's greedy output."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import KV_CACHE_BYTES, ServerProcess, free_port, metrics, sonar_command

from sonar.kv_transfer import kv_wire, nixl_wire
from sonar.kv_transfer.nixl_connector import nixl_api, nixl_module_name

if nixl_module_name() is None:
    pytest.skip("the nixl package is not installed (pip install --no-deps nixl-cu12)", allow_module_level=True)

PRODUCER = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_transfer_timeout": 3}}'
CONSUMER = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'
PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, " * 4
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships that cross it. " * 3}]


def _server(model: str, config: str) -> ServerProcess:
    return ServerProcess(
        [model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512", "--kv-transfer-config", config]
    )


@pytest.fixture(scope="module")
def servers(tiny_model: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The prefill and the decode server, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(_server, tiny_model, config) for config in (PRODUCER, CONSUMER)]
    processes = [future.result() for future in started]
    yield processes[0], processes[1]
    for process in processes:
        _kill(process)
        process.stop()


@pytest.fixture(scope="module")
def producer(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def consumer(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def proxy_url(producer: ServerProcess, consumer: ServerProcess) -> Iterator[str]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="sonar-proxy-", suffix=".log")[1])
    with log.open("w") as out:
        command = [*sonar_command(), "proxy", "--prefill", producer.url, "--decode", consumer.url, "--port", str(port)]
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(10)
    log.unlink(missing_ok=True)


def _complete(url: str, prompt: str = PROMPT, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0.0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _prefill(url: str, prompt: str = PROMPT) -> dict:
    params = _complete(url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    return params


def _all_blocks_free(url: str, timeout: float = 0.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        if values["sonar:num_kv_blocks_free"] == values["sonar:num_kv_blocks_total"]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _kill(server: ServerProcess) -> None:
    """SIGKILL the server and every process it started (its engine core), as a crash would."""
    if server.process.poll() is not None:
        return
    family = [psutil.Process(server.process.pid)]
    family += family[0].children(recursive=True)
    for process in family:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    server.process.wait(10)
    psutil.wait_procs(family[1:], timeout=10)


@pytest.fixture(scope="module")
def expected(producer: ServerProcess) -> str:
    """One server's greedy completion (the prefill server serves plain requests too)."""
    return _complete(producer.url)["choices"][0]["text"]


def test_prefill_on_one_server_and_decode_on_another_over_nixl_equal_one_server(producer, consumer, expected) -> None:
    params = _prefill(producer.url)
    assert not _all_blocks_free(producer.url)  # kept for the decode server to read
    before = metrics(consumer.url)
    decoded = _complete(consumer.url, kv_transfer_params=params)
    after = metrics(consumer.url)
    assert decoded["choices"][0]["text"] == expected
    prompt_tokens = decoded["usage"]["prompt_tokens"]
    # the decode server computed the last prompt token only; the rest it read from the prefill server
    assert after["sonar:engine_prompt_tokens_total"] - before["sonar:engine_prompt_tokens_total"] == 1
    assert after["sonar:external_prefix_cache_hits_total"] - before["sonar:external_prefix_cache_hits_total"] == prompt_tokens - 1
    assert after["sonar:kv_transfer_failures_total"] == before["sonar:kv_transfer_failures_total"]
    assert _all_blocks_free(producer.url, timeout=1.0)  # freed on the read's notification, long before the 3 s timeout
    assert _all_blocks_free(consumer.url, timeout=2.0)

    # the decode server's prefix cache holds the prompt now: it reads nothing, and tells the
    # prefill server so
    again = _complete(consumer.url, kv_transfer_params=_prefill(producer.url))
    assert again["choices"][0]["text"] == expected
    assert metrics(consumer.url)["sonar:kv_transfer_failures_total"] == before["sonar:kv_transfer_failures_total"]
    assert _all_blocks_free(producer.url, timeout=1.0)


def test_through_the_proxy_with_the_openai_client(producer, consumer, proxy_url, expected) -> None:
    import openai

    before = metrics(consumer.url)
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0)
    assert completion.choices[0].text == expected
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected

    direct = openai.OpenAI(base_url=f"{producer.url}/v1", api_key="unused", max_retries=0)
    chat_expected = direct.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0)
    assert chat.choices[0].message.content == chat_expected.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == chat_expected.choices[0].message.content
    after = metrics(consumer.url)
    # every one of the four went over NIXL (the decode server's prefix cache may hold the earlier
    # identical prompts, but each read still happened and none failed)
    assert after["sonar:kv_transfer_failures_total"] == before["sonar:kv_transfer_failures_total"]
    assert after["sonar:engine_prompt_tokens_total"] - before["sonar:engine_prompt_tokens_total"] == 4
    assert _all_blocks_free(producer.url, timeout=2.0)


def _closed_without_answer(params: dict, data: bytes) -> bool:
    """Send ``data`` to the side channel: whether it closed the connection without a word."""
    with _connect(params) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            return sock.recv(1024) == b""
        except OSError as exc:  # reset: closed with our bytes unread
            return not isinstance(exc, TimeoutError)


def _connect(params: dict) -> socket.socket:
    return socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10)


def _hello(**changes) -> nixl_wire.NixlHello:
    fields = {
        "version": nixl_wire.PROTOCOL_VERSION, "engine_id": "test", "model": "", "dtype": "float32", "block_size": 16,
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "tensor_parallel_size": 1,
    }
    return nixl_wire.NixlHello(**{**fields, **changes})


def test_the_side_channel_refuses_another_layout_and_malformed_frames(producer, consumer, tiny_model, expected, tmp_path) -> None:
    params = _prefill(producer.url)
    model = f"{Path(tiny_model).name}:LlamaForCausalLM"
    with _connect(params) as sock:  # the same layout: the agent metadata and the cache's addresses
        nixl_wire.send_message(sock, _hello(model=model))
        reply = nixl_wire.recv_message(sock, nixl_wire.NixlHelloReply)
    assert reply.ok and reply.engine_id == params["remote_engine_id"] and reply.mem_type == "DRAM"
    assert len(reply.layer_addresses) == 2 and reply.block_bytes == 16 * 2 * 16 * 4 and reply.agent_metadata
    with _connect(params) as sock:  # another block size: refused, naming the difference
        nixl_wire.send_message(sock, _hello(model=model, block_size=32))
        reply = nixl_wire.recv_message(sock, nixl_wire.NixlHelloReply)
    assert not reply.ok and "block_size 16 != 32" in reply.error and not reply.agent_metadata
    with _connect(params) as sock:
        nixl_wire.send_message(sock, _hello(model="other-model:MistralForCausalLM", num_kv_heads=8))
        error = nixl_wire.recv_message(sock, nixl_wire.NixlHelloReply).error
    assert "model" in error and "num_kv_heads 2 != 8" in error
    with _connect(params) as sock:  # a SonarConnector engine is told what this port speaks
        hello = kv_wire.Hello(kv_wire.PROTOCOL_VERSION, "sonar", model, "float32", 16, 2, 2, 16, 1)
        kv_wire.send_message(sock, hello)
        reply = kv_wire.recv_message(sock, kv_wire.HelloReply)
    assert not reply.ok and "NixlConnector" in reply.error

    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    garbage = [os.urandom(4096), pickle.dumps(Payload()), struct.pack("<I", 40) + pickle.dumps(Payload())[:40], struct.pack("<I", 2**31)]
    for data in garbage:
        assert _closed_without_answer(params, data)
    assert not marker.exists()

    # the blocks the handshakes above never read are still served
    decoded = _complete(consumer.url, kv_transfer_params=params)
    assert decoded["choices"][0]["text"] == expected
    assert _all_blocks_free(producer.url, timeout=2.0)


class _LyingSideChannel:
    """A side channel that answers every hello with a real NIXL agent's metadata but a cache
    of ``num_blocks`` at addresses that agent never registered."""

    def __init__(self, engine_id: str, num_layers: int, block_bytes: int, num_blocks: int) -> None:
        import torch

        api = nixl_api()
        self.agent = api.nixl_agent(f"liar-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.memory = torch.zeros(4096, dtype=torch.uint8)
        self.agent.register_memory([self.memory])
        self.reply = nixl_wire.NixlHelloReply(
            True, engine_id, agent_name=f"liar-{os.getpid()}", agent_metadata=self.agent.get_agent_metadata(), mem_type="DRAM",
            layer_addresses=[self.memory.data_ptr() + (1 << 30) * (i + 1) for i in range(num_layers)],
            num_blocks=num_blocks, block_bytes=block_bytes,
        )
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answered = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                nixl_wire.recv_message(conn, nixl_wire.NixlHello)
                nixl_wire.send_message(conn, self.reply)
                self.answered += 1

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self._thread.join(5)


def test_a_decode_server_recomputes_when_the_prefill_side_lies_or_is_unreachable(producer, consumer, tiny_model) -> None:
    prompt = "A prompt the decode server has never seen, so that nothing of it is cached there. " * 3
    expected = _complete(producer.url, prompt)["choices"][0]["text"]
    params = _prefill(producer.url, prompt)  # never read: the prefill server frees it after its 3 s timeout
    before = metrics(consumer.url)["sonar:kv_transfer_failures_total"]

    liar = _LyingSideChannel(params["remote_engine_id"], num_layers=2, block_bytes=16 * 2 * 16 * 4, num_blocks=64)
    try:
        attempts = [
            {**params, "remote_port": liar.port},  # descriptors outside what its agent registered: NIXL refuses them
            {**params, "remote_port": free_port()},  # nothing listens there
            {**params, "remote_engine_id": "another-engine"},  # the port's engine is not the one that prefilled
        ]
        for attempt in attempts:
            decoded = _complete(consumer.url, prompt, kv_transfer_params=attempt)
            assert decoded["choices"][0]["text"] == expected
        assert liar.answered == 1
    finally:
        liar.close()
    assert metrics(consumer.url)["sonar:kv_transfer_failures_total"] == before + len(attempts)
    assert _all_blocks_free(consumer.url, timeout=2.0)
    assert _all_blocks_free(producer.url, timeout=6.0)  # unread: freed after the timeout
    with _connect(params) as sock:  # and perhaps reused since: a read of them is refused
        nixl_wire.send_message(sock, _hello(model=f"{Path(tiny_model).name}:LlamaForCausalLM", request_id=params["remote_request_id"]))
        reply = nixl_wire.recv_message(sock, nixl_wire.NixlHelloReply)
    assert not reply.ok and "blocks were freed unread after kv_transfer_timeout (3 s)" in reply.error


def test_a_prefill_server_killed_before_the_read(producer, consumer, expected) -> None:
    """Last in the module: it kills the shared prefill server (the decode server has read from
    it before, so it holds the dead engine's agent)."""
    prompt = "A prompt whose prefill server dies before its blocks are read, never seen before. " * 3
    expected_here = _complete(producer.url, prompt)["choices"][0]["text"]
    params = _prefill(producer.url, prompt)
    _kill(producer)
    before = metrics(consumer.url)["sonar:kv_transfer_failures_total"]
    started = time.monotonic()
    decoded = _complete(consumer.url, prompt, kv_transfer_params=params)
    assert time.monotonic() - started < 20  # refused at once, recomputed: no wait on the dead peer
    assert decoded["choices"][0]["text"] == expected_here
    assert metrics(consumer.url)["sonar:kv_transfer_failures_total"] == before + 1
    assert _all_blocks_free(consumer.url, timeout=2.0)
    assert httpx.get(f"{consumer.url}/health").status_code == 200
    assert _complete(consumer.url)["choices"][0]["text"] == expected  # and it serves on
