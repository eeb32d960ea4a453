"""``sonar serve`` as processes: API servers and engine cores apart, several of each, and
what happens when one of them dies or a socket is fed garbage."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess, metrics

COMMON = ["--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512"]
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a bright cold day", "Call me", "Hello"]


def descendants(pid: int) -> dict[int, str]:
    """Every live process under ``pid``, with its title (``sonar::engine-core-0``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            stack.append(child)
    return found


def by_title(pid: int, title: str) -> list[int]:
    return [p for p, name in descendants(pid).items() if name.startswith(title)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def mp_server(tiny_model: str, tmp_path_factory) -> ServerProcess:
    ipc = tmp_path_factory.mktemp("ipc")
    process = ServerProcess([tiny_model, *COMMON, "--api-server-count", "2", "--data-parallel-size", "2"], env={"SONAR_IPC_DIR": str(ipc)})
    process.ipc_dir = ipc  # type: ignore[attr-defined]
    yield process
    process.stop()


def test_every_role_runs_in_its_own_titled_process(mp_server: ServerProcess) -> None:
    titles = sorted(name for name in descendants(mp_server.process.pid).values() if name.startswith("sonar::"))
    assert titles == ["sonar::api-server-0", "sonar::api-server-1", "sonar::engine-core-0", "sonar::engine-core-1"]
    assert Path(f"/proc/{mp_server.process.pid}/cmdline").read_bytes().startswith(b"sonar::serve")


def test_sdks_through_two_api_servers_and_two_replicas(mp_server: ServerProcess, oracle) -> None:
    import anthropic
    import openai

    from sonar import SamplingParams

    expected = [o.outputs[0].text for o in oracle.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    client = openai.OpenAI(base_url=f"{mp_server.url}/v1", api_key="unused", max_retries=0)
    results: dict[int, str] = {}

    def complete(i: int) -> None:
        if i % 2:  # streamed
            chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
            results[i] = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            results[i] = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[i] for i in range(len(PROMPTS))] == expected

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)

    messages = anthropic.Anthropic(base_url=mp_server.url, api_key="unused", max_retries=0)
    with messages.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 8 and final.stop_reason == "max_tokens"

    kobold = httpx.post(f"{mp_server.url}/api/v1/generate", json={"prompt": PROMPTS[0], "max_length": 12, "temperature": 0.01, "top_k": 1}, timeout=60)
    assert kobold.status_code == 200 and kobold.json()["results"][0]["text"]


def test_kobold_check_and_abort_reach_the_generation_from_any_connection(mp_server: ServerProcess) -> None:
    """A Kobold client's check and abort come on connections of their own, which the kernel
    spreads over both API servers: each reads or stops the generation wherever it runs."""
    ipc = next(Path(mp_server.ipc_dir).glob("sonar-ipc-*"))  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while not {"peer-0", "peer-1"} <= {p.name for p in ipc.iterdir()}:  # both API servers up
        assert time.monotonic() < deadline, "an API server never bound its peer socket"
        time.sleep(0.05)
    body = {"prompt": PROMPTS[1], "max_length": 500, "temperature": 0, "genkey": "KCPP-mp", "ban_eos_token": True}
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("response", httpx.post(f"{mp_server.url}/api/v1/generate", json=body, timeout=60)))
    worker.start()
    deadline = time.monotonic() + 20
    while not httpx.post(f"{mp_server.url}/api/extra/generate/check", json={"genkey": "KCPP-mp"}).json()["results"][0]["text"]:
        assert time.monotonic() < deadline, "the generation never showed progress"
        time.sleep(0.02)
    texts = [httpx.post(f"{mp_server.url}/api/extra/generate/check", json={"genkey": "KCPP-mp"}).json()["results"][0]["text"] for _ in range(3)]
    assert all(texts) and all(b.startswith(a) for a, b in zip(texts, texts[1:])), [len(t) for t in texts]
    assert httpx.post(f"{mp_server.url}/api/extra/abort", json={"genkey": "KCPP-mp"}).json()["success"] == "true"
    worker.join(30)
    final = result["response"].json()["results"][0]
    assert final["finish_reason"] == "abort" and final["text"].startswith(texts[-1])


def test_metrics_are_one_view_across_processes(mp_server: ServerProcess) -> None:
    before = metrics(mp_server.url).get("sonar:request_success_total", 0.0)
    for _ in range(8):  # new connections: the kernel spreads them over both API servers
        response = httpx.post(f"{mp_server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 200
    seen = [metrics(mp_server.url) for _ in range(6)]
    assert all(m["sonar:request_success_total"] - before == 8 for m in seen)  # whichever process answered
    assert all(m["sonar:num_kv_blocks_total"] == seen[0]["sonar:num_kv_blocks_total"] > 0 for m in seen)
    health = httpx.get(f"{mp_server.url}/health").json()
    assert health["status"] == "ok" and [e["state"] for e in health["engines"]] == ["ok", "ok"]


def test_garbage_on_the_sockets_runs_no_code_and_serving_goes_on(mp_server: ServerProcess, tmp_path: Path, oracle) -> None:
    import zmq

    from sonar import SamplingParams

    ipc_dirs = list(Path(mp_server.ipc_dir).glob("sonar-ipc-*"))  # type: ignore[attr-defined]
    assert len(ipc_dirs) == 1
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Exploit())
    rng = random.Random(0)
    context = zmq.Context()
    try:
        for name in sorted(p.name for p in ipc_dirs[0].iterdir()):
            kind = zmq.PUSH if name.startswith("output") else zmq.DEALER
            socket = context.socket(kind)
            socket.setsockopt(zmq.LINGER, 1000)
            if kind == zmq.DEALER:
                socket.setsockopt(zmq.IDENTITY, b"\x00\x00")  # pretend to be engine core 0
            socket.connect(f"ipc://{ipc_dirs[0] / name}")
            for _ in range(50):
                socket.send_multipart([bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(rng.randrange(1, 4))])
            for first in (b"\x11", b"\x12", b"\x10", b"\x00"):
                socket.send_multipart([first, payload])
                socket.send_multipart([first, b"\xc1\xff\x00"])
            socket.send(payload)
            socket.close()
    finally:
        context.term()
    time.sleep(1.0)
    assert not marker.exists()
    expected = oracle.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    for _ in range(4):
        response = httpx.post(f"{mp_server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}, timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    assert httpx.get(f"{mp_server.url}/health").json()["status"] == "ok"


def _stream_until_error(url: str, results: list, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()
    except httpx.HTTPError as exc:
        events.append({"transport_error": str(exc)})
    results.append((time.monotonic(), events))


def test_killed_engine_core_fails_its_requests_fast_and_nothing_is_left_behind(tiny_model: str) -> None:
    server = ServerProcess([tiny_model, *COMMON, "--api-server-count", "2"])
    try:
        (engine,) = by_title(server.process.pid, "sonar::engine-core-0")
        results: list = []
        started = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=_stream_until_error, args=(server.url, results, s)) for s in started]
        for thread in threads:
            thread.start()
        assert all(s.wait(30) for s in started), "the streams started"
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for thread in threads:
            thread.join(10)
        assert len(results) == 3
        for ended_at, events in results:
            assert ended_at - killed_at < 2.0
            assert "error" in events[-1] and events[-1]["error"]["code"] == 503, events[-1]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert late.status_code == 503 and "engine" in late.json()["error"]["message"]
        anthropic_late = httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, timeout=5)
        assert anthropic_late.status_code == 503 and anthropic_late.json()["type"] == "error"
        family = descendants(server.process.pid)
    finally:
        code = server.stop(timeout=30)
    assert code == 0
    time.sleep(0.5)
    assert not [pid for pid in family if alive(pid)], "no process outlives sonar serve"


def _wait_health(url: str, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(f"{url}/health", timeout=5).json()
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def test_a_stuck_or_dead_replica_takes_down_only_its_own_requests(tiny_model: str) -> None:
    server = ServerProcess([tiny_model, *COMMON, "--data-parallel-size", "2", "--engine-step-timeout", "1"])
    try:
        (stuck,) = by_title(server.process.pid, "sonar::engine-core-0")
        os.kill(stuck, signal.SIGSTOP)  # alive, but no step and no word from it
        try:
            body = _wait_health(server.url, "degraded", 5.0)
            assert [e["state"] for e in body["engines"]] == ["stuck", "ok"]
        finally:
            os.kill(stuck, signal.SIGCONT)
        _wait_health(server.url, "ok", 5.0)
        (engine,) = by_title(server.process.pid, "sonar::engine-core-1")
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while httpx.get(f"{server.url}/health").json()["status"] != "degraded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200
        assert [e["state"] for e in health.json()["engines"]] == ["ok", "dead"]
        for _ in range(4):
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
            assert response.status_code == 200
    finally:
        assert server.stop() == 0


def test_children_exit_when_sonar_serve_is_killed(tiny_model: str) -> None:
    server = ServerProcess([tiny_model, *COMMON, "--api-server-count", "2"])
    family = descendants(server.process.pid)
    assert len([n for n in family.values() if n.startswith("sonar::")]) == 3
    server.process.kill()
    server.process.wait()
    deadline = time.monotonic() + 5.0
    while any(alive(pid) for pid in family):
        assert time.monotonic() < deadline, f"left behind: {[family[p] for p in family if alive(p)]}"
        time.sleep(0.1)
    server.stop()


FAILS_IN_API_SERVER_1 = """
import setproctitle

if setproctitle.getproctitle() == "sonar::api-server-1":  # the other API servers start
    raise RuntimeError("api-server-1 cannot start")


class Tag:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
"""


def test_an_api_server_failing_to_start_stops_sonar_serve(tiny_model: str, tmp_path: Path) -> None:
    """One of three API servers fails as it starts (an uncaught error, not a refused option):
    ``sonar serve`` says which one, exits 3, and leaves no API server or engine core behind."""
    from conftest import free_port, sonar_command

    (tmp_path / "fails_in_one.py").write_text(FAILS_IN_API_SERVER_1)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = tmp_path / "serve.log"
    command = [*sonar_command(), "serve", tiny_model, *COMMON, "--api-server-count", "3", "--middleware", "fails_in_one.Tag", "--port", str(free_port())]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        family: dict[int, str] = {}
        deadline = time.monotonic() + 120
        try:
            while process.poll() is None and time.monotonic() < deadline:
                family.update(descendants(process.pid))
                time.sleep(0.05)
        finally:
            if process.poll() is None:  # it kept serving with two API servers
                process.terminate()
                process.wait(30)
                pytest.fail(f"sonar serve went on after an API server failed to start:\n{log.read_text()[-3000:]}")
    output = log.read_text()
    assert process.returncode == 3, output[-3000:]
    assert "RuntimeError: api-server-1 cannot start" in output  # the child's own error
    assert "API server 1 exited (code 1) before it started serving" in output
    # children were seen (their titles may not be set yet when the failure comes: a loaded
    # machine), and none is left
    assert len(family) >= 2, family
    left = [family[pid] for pid in family if alive(pid)]
    assert not left, f"left behind: {left}"


def test_an_api_server_dying_while_serving_stops_sonar_serve(tiny_model: str, tmp_path: Path) -> None:
    """One of two serving API servers is killed: ``sonar serve`` says which and how, exits 4
    within seconds, and leaves no API server or engine core behind."""
    from conftest import free_port, sonar_command

    port = free_port()
    log = tmp_path / "serve.log"
    command = [*sonar_command(), "serve", tiny_model, *COMMON, "--api-server-count", "2", "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()[-3000:]
                serving = [f"API server {i} is serving" in log.read_text() for i in (0, 1)]
                if all(serving) and by_title(process.pid, "sonar::api-server-1"):
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"sonar serve did not come up:\n{log.read_text()[-3000:]}")
            family = descendants(process.pid)
            victim = by_title(process.pid, "sonar::api-server-1")[0]
            os.kill(victim, signal.SIGKILL)
            process.wait(30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(30)
                pytest.fail(f"sonar serve went on after an API server died:\n{log.read_text()[-3000:]}")
    output = log.read_text()
    assert process.returncode == 4, output[-3000:]
    assert "API server 1 exited (killed by SIGKILL) while serving" in output
    left = [family[pid] for pid in family if alive(pid)]
    assert not left, f"left behind: {left}"


def test_port_in_use_is_refused_before_loading(tiny_model: str) -> None:
    import socket

    from conftest import sonar_command

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run([*sonar_command(), "serve", tiny_model, *COMMON, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading" not in result.stderr and time.monotonic() - started < 30


def test_test_servers_fork_from_the_preloaded_server_unless_the_environment_differs(server: ServerProcess) -> None:
    """The suite's servers start forked (``sonar_server.testing``), so that dozens of them do
    not each import torch again; a caller with another environment (beyond Sonar's own
    settings) gets a fresh interpreter, as an import may have read it."""
    from conftest import serve_forks
    from sonar.engine.fork_server import ForkServerProcess

    assert isinstance(server.process, ForkServerProcess)
    assert Path(f"/proc/{server.process.pid}/cmdline").read_bytes().startswith(b"sonar::api-server-0")  # its title, as sonar serve sets it
    with open(os.devnull, "w") as sink:
        assert serve_forks().start(["serve", "--help"], {**os.environ, "PYTHONPATH": "/elsewhere"}, sink.fileno()) is None
        child = serve_forks().start(["serve", "--help"], {**os.environ, "SONAR_IPC_DIR": "/elsewhere"}, sink.fileno())
        assert isinstance(child, ForkServerProcess) and child.wait(60) == 0
