"""Prefill/decode disaggregation with the built-in SonarConnector: a prefill server, a decode
server and ``sonar proxy``, all real processes on loopback, against one server's greedy output."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import KV_CACHE_BYTES, ServerProcess, free_port, metrics, sonar_command

from sonar.kv_transfer import kv_wire

PRODUCER = '{"kv_connector": "SonarConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_transfer_timeout": 3}}'
CONSUMER = '{"kv_connector": "SonarConnector", "kv_role": "kv_consumer"}'
CONSUMER_TCP = '{"kv_connector": "SonarConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_transport": "tcp"}}'
PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, " * 4
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships that cross it. " * 3}]


def _server(model: str, config: str, *extra: str) -> ServerProcess:
    return ServerProcess(
        [model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512", "--kv-transfer-config", config, *extra]
    )


@pytest.fixture(scope="module")
def servers(tiny_model: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The prefill and the decode server, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(_server, tiny_model, config) for config in (PRODUCER, CONSUMER)]
    processes = [future.result() for future in started]
    yield processes[0], processes[1]
    for process in processes:
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
        time.sleep(0.2)


@pytest.fixture(scope="module")
def expected(producer: ServerProcess) -> str:
    """One server's greedy completion (the prefill server serves plain requests too)."""
    return _complete(producer.url)["choices"][0]["text"]


def test_prefill_on_one_server_and_decode_on_another_equal_one_server(producer, consumer, expected) -> None:
    params = _prefill(producer.url)
    before = metrics(consumer.url)
    decoded = _complete(consumer.url, kv_transfer_params=params)
    after = metrics(consumer.url)
    assert decoded["choices"][0]["text"] == expected
    assert decoded["kv_transfer_params"] is None
    prompt_tokens = decoded["usage"]["prompt_tokens"]
    # the decode server computed the last prompt token only; the rest came from the prefill server
    assert after["sonar:engine_prompt_tokens_total"] - before["sonar:engine_prompt_tokens_total"] == 1
    assert after["sonar:external_prefix_cache_hits_total"] - before["sonar:external_prefix_cache_hits_total"] == prompt_tokens - 1
    assert _all_blocks_free(producer.url, timeout=2.0)  # freed once pulled, long before the timeout
    assert _all_blocks_free(consumer.url, timeout=2.0)


def test_through_the_proxy_with_the_openai_client(producer, proxy_url, expected) -> None:
    import openai

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
    assert httpx.get(f"{proxy_url}/health").json()["decode"][0]["in_flight"] == 0


def test_a_decode_server_whose_prefill_server_is_gone_computes_the_prompt(producer, consumer) -> None:
    prompt = "A prompt the decode server has never seen, so that nothing of it is cached there. " * 3
    expected = _complete(producer.url, prompt)["choices"][0]["text"]
    params = _prefill(producer.url, prompt)  # never pulled: the prefill server frees it after its 3 s timeout
    assert not _all_blocks_free(producer.url)
    before = metrics(consumer.url)["sonar:kv_transfer_failures_total"]
    gone = {**params, "remote_port": free_port()}  # nothing listens there any more
    decoded = _complete(consumer.url, prompt, kv_transfer_params=gone)
    assert decoded["choices"][0]["text"] == expected
    assert metrics(consumer.url)["sonar:kv_transfer_failures_total"] == before + 1
    assert _all_blocks_free(producer.url, timeout=6.0)
    assert _all_blocks_free(consumer.url, timeout=2.0)


def _closed_without_answer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True
    except OSError as error:  # already torn down on our side by the reset
        return error.errno == errno.ENOTCONN


def _connect(params: dict) -> socket.socket:
    return socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10)


def _hello(**changes) -> kv_wire.Hello:
    fields = dict(
        version=kv_wire.PROTOCOL_VERSION, engine_id="test", model="", dtype="float32", block_size=16, num_layers=2,
        num_kv_heads=2, head_dim=16, tensor_parallel_size=1,
    )
    fields.update(changes)
    return kv_wire.Hello(**fields)


def test_the_kv_port_refuses_another_layout_and_malformed_frames(producer, consumer, tiny_model, expected, tmp_path) -> None:
    params = _prefill(producer.url)
    model = f"{Path(tiny_model).name}:LlamaForCausalLM"
    with _connect(params) as sock:  # another block size: refused, naming the difference
        kv_wire.send_message(sock, _hello(model=model, block_size=32))
        reply = kv_wire.recv_message(sock, kv_wire.HelloReply)
    assert not reply.ok and "block_size 16 != 32" in reply.error
    with _connect(params) as sock:
        kv_wire.send_message(sock, _hello(model="other-model:MistralForCausalLM"))
        assert "model" in kv_wire.recv_message(sock, kv_wire.HelloReply).error

    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    garbage = [os.urandom(4096), pickle.dumps(Payload()), struct.pack("<I", 40) + pickle.dumps(Payload())[:40], struct.pack("<I", 2**31)]
    for data in garbage:
        with _connect(params) as sock:
            sock.sendall(data)
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the port already closed it: what the check below looks for
                pass
            assert _closed_without_answer(sock)
    assert not marker.exists()

    # a decode engine that goes away mid-transfer: the prefill server frees the blocks at once
    with _connect(params) as sock:
        kv_wire.send_message(sock, _hello(model=model))
        assert kv_wire.recv_message(sock, kv_wire.HelloReply).ok
        kv_wire.send_message(sock, kv_wire.Pull(params["remote_request_id"], params["remote_block_ids"]))
        assert kv_wire.recv_message(sock, kv_wire.PullReply).ok
        sock.recv(100)
    assert _all_blocks_free(producer.url, timeout=2.0)  # well before its 3 s timeout

    # the port still serves a real pull
    decoded = _complete(consumer.url, kv_transfer_params=_prefill(producer.url))
    assert decoded["choices"][0]["text"] == expected


# -- peers killed with SIGKILL -------------------------------------------------------------------

VICTIM_PRODUCER = '{"kv_connector": "SonarConnector", "kv_role": "kv_producer"}'
LONG_PROMPT = "The harbour master wrote down every ship, its cargo, its crew and the hour it came in. " * 18


@pytest.fixture(scope="module")
def victims(tiny_model: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A second prefill server (its timeout from --kv-transfer-timeout) and a second decode
    server that pulls over TCP only, started side by side, each to be killed by a test."""
    with ThreadPoolExecutor(2) as pool:
        started = [
            pool.submit(_server, tiny_model, VICTIM_PRODUCER, "--kv-transfer-timeout", "3"),
            # frames over TCP, which a kill can cut; a long context, so a decode outlasts the poll that kills it
            pool.submit(_server, tiny_model, CONSUMER_TCP, "--max-model-len", "2048"),
        ]
    processes = [future.result() for future in started]
    yield processes[0], processes[1]
    for process in processes:
        _kill(process)
        process.stop()


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


def _connection_open_to(port: int) -> bool:
    """Whether some loopback TCP connection to ``port`` is established (read from /proc/net/tcp,
    fast enough to poll in a tight loop)."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def test_a_decode_server_pulling_over_tcp_equals_one_server(victims, producer, expected) -> None:
    _, tcp_consumer = victims
    params = _prefill(producer.url)
    before = metrics(tcp_consumer.url)["sonar:external_prefix_cache_hits_total"]
    decoded = _complete(tcp_consumer.url, kv_transfer_params=params)
    assert decoded["choices"][0]["text"] == expected
    hits = metrics(tcp_consumer.url)["sonar:external_prefix_cache_hits_total"] - before
    assert hits == decoded["usage"]["prompt_tokens"] - 1
    assert _all_blocks_free(producer.url, timeout=2.0)


def test_on_one_host_the_cache_is_shared_read_only_with_the_same_user_only(producer, tiny_model) -> None:
    """A puller on this host is offered the prefill cache in shared memory; one that says it is
    elsewhere is not; the memory it maps is the prefill server's blocks, and read-only."""

    import torch

    from sonar.kv_transfer.cuda_ipc import host_identity
    from sonar.kv_transfer.host_shm import map_kv_caches

    params = _prefill(producer.url)
    model = f"{Path(tiny_model).name}:LlamaForCausalLM"
    with _connect(params) as sock:
        kv_wire.send_message(sock, _hello(model=model, host_id="elsewhere/0"))
        assert kv_wire.recv_message(sock, kv_wire.HelloReply).shm is None
    with _connect(params) as sock:
        kv_wire.send_message(sock, _hello(model=model, host_id=host_identity()))
        reply = kv_wire.recv_message(sock, kv_wire.HelloReply)
    assert reply.ok and reply.shm is not None and reply.shm.name.startswith("sonar-kv-")
    like = [torch.zeros(2, 1, 16, 2, 16) for _ in range(2)]
    layers, mapping = map_kv_caches(reply.shm.name, reply.shm.layer_bytes, reply.shm.num_blocks, like)
    assert layers[0].shape[1] == reply.shm.num_blocks
    blocks = layers[0].index_select(1, torch.tensor(params["remote_block_ids"]))
    assert blocks.abs().sum() > 0  # the prompt's keys and values are there
    with pytest.raises(TypeError):
        mapping[0] = 1  # mapped read-only
    with pytest.raises(ValueError, match="not a Sonar KV-cache socket"):
        map_kv_caches("/etc/passwd", reply.shm.layer_bytes, reply.shm.num_blocks, like)
    with pytest.raises(ValueError, match="blocks take"):
        map_kv_caches(reply.shm.name, reply.shm.layer_bytes + 4, reply.shm.num_blocks, like)


def test_a_prefill_server_killed_before_the_pull(victims, producer, consumer) -> None:
    victim, _ = victims
    prompt = "A prompt whose prefill server dies before its blocks are pulled, never seen before. " * 3
    expected = _complete(producer.url, prompt)["choices"][0]["text"]
    params = _prefill(victim.url, prompt)
    _kill(victim)
    before = metrics(consumer.url)["sonar:kv_transfer_failures_total"]
    started = time.monotonic()
    decoded = _complete(consumer.url, prompt, kv_transfer_params=params)
    assert time.monotonic() - started < 20  # refused at once, recomputed: no wait on the dead peer
    assert decoded["choices"][0]["text"] == expected
    assert metrics(consumer.url)["sonar:kv_transfer_failures_total"] == before + 1
    assert _all_blocks_free(consumer.url, timeout=2.0)


def test_a_decode_server_killed_while_pulling(victims, producer, consumer) -> None:
    _, victim = victims
    assert _all_blocks_free(producer.url, timeout=6.0)  # the baseline: earlier prefills freed
    params = _prefill(producer.url, LONG_PROMPT)
    assert len(params["remote_block_ids"]) >= 18  # ~340 prompt tokens
    assert not _all_blocks_free(producer.url)

    def decode() -> int | None:
        body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True, "kv_transfer_params": params}
        try:
            return httpx.post(f"{victim.url}/v1/completions", json=body, timeout=30).status_code
        except httpx.HTTPError:
            return None  # the server died under it

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(decode)
        deadline = time.monotonic() + 10
        # kill it the moment its engine connects to the KV port; the pull of a tiny model's blocks
        # takes about a millisecond, so where the poll misses it the kill comes right after it,
        # while the request decodes (the bytes cut mid-frame are the raw-socket test's above)
        while time.monotonic() < deadline and not answer.done():
            if _connection_open_to(params["remote_port"]) or _all_blocks_free(producer.url):
                break
        _kill(victim)
        assert answer.result() is None
    # freed at once if the pull broke off, after the 3 s timeout had the kill come before it
    assert _all_blocks_free(producer.url, timeout=6.0)
    assert httpx.get(f"{producer.url}/health").status_code == 200
    expected = _complete(producer.url, LONG_PROMPT)["choices"][0]["text"]
    decoded = _complete(consumer.url, LONG_PROMPT, kv_transfer_params=_prefill(producer.url, LONG_PROMPT))
    assert decoded["choices"][0]["text"] == expected


def _stream_events(url: str, route: str, body: dict) -> list[dict]:
    import json

    events = []
    with httpx.stream("POST", f"{url}{route}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_a_streamed_prefill_returns_kv_transfer_params_on_its_finishing_chunk(producer, consumer, expected) -> None:
    fields = {"model": "tiny", "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}}
    events = _stream_events(producer.url, "/v1/completions", {**fields, "prompt": PROMPT})
    carrying = [e for e in events if "kv_transfer_params" in e]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] is not None
    params = carrying[0]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    decoded = _complete(consumer.url, kv_transfer_params=params)  # the streamed parameters are pulled like the others
    assert decoded["choices"][0]["text"] == expected

    events = _stream_events(producer.url, "/v1/chat/completions", {**fields, "messages": MESSAGES})
    carrying = [e for e in events if "kv_transfer_params" in e]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] is not None
    assert carrying[0]["kv_transfer_params"]["remote_block_ids"]
    # an ordinary streamed request carries none
    assert not any("kv_transfer_params" in e for e in _stream_events(producer.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}))
    assert _all_blocks_free(producer.url, timeout=6.0)  # the chat prefill, never pulled, freed after the timeout
