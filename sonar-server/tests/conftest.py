"""A real ``sonar serve`` subprocess on a free port with a tiny random model, and the offline
``LLM`` on the same model as the oracle."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

KV_CACHE_BYTES = str(16 * 1024 * 1024)
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sonar_command() -> list[str]:
    executable = shutil.which("sonar", path=str(Path(sys.executable).parent)) or shutil.which("sonar")
    return [executable] if executable else [sys.executable, "-m", "sonar.cli.main"]


_forks = None


def serve_forks():
    """This session's fork server for ``sonar serve`` (``sonar_server.testing``), started on
    first use: a server forked from it starts in about 2 s instead of 8."""
    global _forks
    if _forks is None:
        from sonar_server.testing import ServeForks

        _forks = ServeForks()
    return _forks


class ServerProcess:
    """``sonar serve <args>`` in a subprocess; ``url`` once it answers /health (over HTTPS
    with ``verify``: the CA file its certificate is checked against). It is forked from the
    session's preloaded fork server where the environment allows (``ServeForks.start``), else
    a fresh interpreter runs the console script."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, verify: str | None = None) -> None:
        self.port = free_port()
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=verify) if verify else True
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="sonar-serve-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        arguments = ["serve", *args, "--port", str(self.port)]
        environment = {**os.environ, **(env or {})}
        self.process = serve_forks().start(arguments, environment, self._log.fileno())
        if self.process is None:
            self.process = subprocess.Popen([*sonar_command(), *arguments], stdout=self._log, stderr=subprocess.STDOUT, env=environment)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sonar serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sonar serve did not become healthy in {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        if self._log.closed:  # stopped: the file is gone, its text kept
            return self._final_log
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
            self._final_log = self.log_path.read_text()
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` and, summed over labels, ``{"name": value}``."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        name = key.split("{")[0]
        values[name] = values.get(name, 0.0) + float(value) if name != key else float(value)
    return values


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[str]:
    from sonar_models.testing import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="sonar-server-tiny-"))
    build_tiny_model("llama", folder)
    yield str(folder)
    shutil.rmtree(folder, ignore_errors=True)


BODY_TIMEOUT_S = 3.0


@pytest.fixture(scope="session")
def server(tiny_model: str) -> Iterator[ServerProcess]:
    """The shared server: every API, no key, tiny model under the name ``tiny``; a request body
    must arrive within ``BODY_TIMEOUT_S``."""
    process = ServerProcess([
        tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
        "--request-read-timeout", str(BODY_TIMEOUT_S),
    ])
    yield process
    process.stop()


@pytest.fixture(scope="session")
def embedded_server() -> Iterator[ServerProcess]:
    """A plain ``sonar serve`` (no arguments but the port): the embedded default model, shared
    by every test that needs the real model behind the server (started on first use)."""
    process = ServerProcess([])
    yield process
    process.stop()


@pytest.fixture(scope="session")
def tools_server(tiny_model: str) -> Iterator[ServerProcess]:
    """A second server with automatic tool choice, a reasoning parser and request chat templates allowed, shared by the
    structured-output, tool and reasoning tests (started on first use)."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--trust-request-chat-template"]
    process = ServerProcess(
        [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512", *flags]
    )
    yield process
    process.stop()


@pytest.fixture(scope="session")
def tools_url(tools_server: ServerProcess) -> str:
    return tools_server.url


@pytest.fixture(scope="session")
def tools_client(tools_url: str):
    """The official OpenAI client on the tools server."""
    import openai

    return openai.OpenAI(base_url=f"{tools_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def oracle(tiny_model: str):
    """The offline LLM on the same model: what the server's greedy outputs must equal."""
    from sonar import LLM

    return LLM(tiny_model, kv_cache_memory_bytes=int(KV_CACHE_BYTES), max_model_len=512)
