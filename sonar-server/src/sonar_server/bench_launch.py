"""The server ``sonar bench serve`` measures: a running one it waits for, or ``sonar serve``
started here on a free port and stopped afterwards."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def healthy(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """``sonar serve MODEL --port PORT [--server-args]`` in a subprocess, logging to a file."""

    def __init__(self, model: str, port: int, server_args: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        handle, log_path = tempfile.mkstemp(prefix="sonar-bench-serve-", suffix=".log")
        os.close(handle)
        self.log_path = Path(log_path)
        command = [sys.executable, "-m", "sonar.cli.main", "serve", model, "--port", str(port), *shlex.split(server_args)]
        print(f"starting sonar {shlex.join(command[3:])} (log: {self.log_path})", file=sys.stderr, flush=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sonar serve exited with {self.process.returncode} before answering /health:\n{self.log_tail()}")
            if healthy(self.url):
                return
            time.sleep(0.25)
        raise RuntimeError(f"sonar serve did not answer /health within {timeout:.0f} s (raise --ready-check-timeout-sec):\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after a minute; the log stays only if it failed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode == 0:
            self.log_path.unlink(missing_ok=True)


def wait_for(base_url: str, timeout: float) -> None:
    if healthy(base_url):
        return
    print(f"no server answers {base_url}/health yet; waiting up to {timeout:.0f} s (--ready-check-timeout-sec)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if healthy(base_url):
            return
    raise RuntimeError(f"no server answers {base_url}/health; start one with `sonar serve MODEL`, or give a MODEL to launch one here")
