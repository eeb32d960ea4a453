"""Two hosts on loopback: a head ``sonar serve -tp 2 --nnodes 2 --node-rank 0`` and a follower
``sonar serve ... --node-rank 1 --headless``, each its own process tree, one rank each, joined
in one gloo group. Through a real HTTP client the pair gives the tokens one device gives; a
follower with other engine options is refused on both sides; a follower that dies fails the
head's requests (503, /health dead); a head that dies takes its followers with it; a follower
that never comes fails the head's start."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess, sonar_command
from test_multiprocess import alive, by_title

PROMPTS = ["The quick brown fox", "Once upon a time"]
ENGINE = ["--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the rendezvous and the control link), below the kernel's
    ephemeral range: a port from that range can be taken, before the head binds it, as the source
    port of one of the follower's connection attempts to P (seen once in CI: "Address already in
    use" for P + 1)."""
    low = _ephemeral_range()[0]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low - 1)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


class Follower:
    """``sonar serve <model> ... --headless`` in its own process, output kept for the asserts."""

    def __init__(self, model: str, master_port: int, *extra: str) -> None:
        command = [*sonar_command(), "serve", model, *ENGINE, "--master-port", str(master_port), "--node-rank", "1", "--headless", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout: float) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=timeout)
        return self.process.returncode, output

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


def _start_head(model: str, master_port: int, started: list[ServerProcess], env: dict[str, str] | None = None) -> threading.Thread:
    """The head, started in a thread: it becomes healthy only once its follower joined."""
    args = [model, "--served-model-name", "tiny", *ENGINE, "--master-port", str(master_port), "--node-rank", "0"]
    thread = threading.Thread(target=lambda: started.append(ServerProcess(args, env=env)), daemon=True)
    thread.start()
    return thread


def _wait_gone(pids: list[int], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_head_and_follower_serve_one_devices_tokens_then_lose_the_follower(tiny_model: str) -> None:
    from sonar import LLM, SamplingParams

    single = LLM(tiny_model, kv_cache_memory_bytes=int(KV_CACHE_BYTES), max_model_len=512)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))]
    del single
    port = _free_port_pair()
    mismatched = Follower(tiny_model, port, "--max-num-seqs", "8")  # waits for the head to come up
    started: list[ServerProcess] = []
    head_thread = _start_head(tiny_model, port, started)
    follower = None
    try:
        code, output = mismatched.wait(timeout=120)
        assert code != 0
        assert "refused node rank 1" in output and "max_num_seqs: head 256, follower 8" in output, output
        follower = Follower(tiny_model, port)
        head_thread.join(timeout=150)
        assert started, "the head became healthy once the follower joined"
        head = started[0]
        assert "refused follower" in head.log() and "max_num_seqs" in head.log()
        # one rank per host: the head's rank 0 under its engine core, rank 1 under the follower
        assert len(by_title(head.process.pid, "sonar::tp-worker-0")) == 1
        follower_ranks = by_title(follower.process.pid, "sonar::tp-worker-1")
        assert len(follower_ranks) == 1
        for prompt, text in zip(PROMPTS, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            reply = httpx.post(f"{head.url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        # the follower host dies
        follower.process.kill()
        started_at = time.monotonic()
        failed = httpx.post(f"{head.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert failed.status_code == 503, failed.text
        assert time.monotonic() - started_at < 15
        deadline = time.monotonic() + 10
        while httpx.get(f"{head.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the head noticed its dead engine"
            time.sleep(0.1)
        assert httpx.get(f"{head.url}/health", timeout=5).json()["status"] == "dead"
        _wait_gone(follower_ranks, 10, "the dead follower's rank exited with it")
    finally:
        for process in started:
            process.stop()
        mismatched.stop()
        if follower is not None:
            follower.stop()


def test_a_head_that_dies_takes_its_follower_with_it(tiny_model: str) -> None:
    port = _free_port_pair()
    started: list[ServerProcess] = []
    head_thread = _start_head(tiny_model, port, started)
    follower = Follower(tiny_model, port)
    try:
        head_thread.join(timeout=150)
        assert started, "the pair started"
        ranks = by_title(follower.process.pid, "sonar::tp-worker-1")
        assert len(ranks) == 1
        started[0].process.kill()  # the head host goes away at once
        code, output = follower.wait(timeout=30)
        assert code != 0 and "is gone" in output, output
        _wait_gone(ranks, 10, "the follower's rank exited with it")
    finally:
        for process in started:
            process.stop()
        follower.stop()


def test_a_follower_that_never_joins_fails_the_heads_start(tiny_model: str) -> None:
    port = _free_port_pair()
    command = [*sonar_command(), "serve", tiny_model, *ENGINE, "--master-port", str(port), "--node-rank", "0", "--port", str(_free_port_pair())]
    env = {**os.environ, "SONAR_WORKER_STARTUP_TIMEOUT_S": "2"}
    head = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert head.returncode != 0
    assert "follower node rank(s) [1] did not join the head" in head.stdout + head.stderr, head.stdout + head.stderr
    assert "--node-rank R" in head.stdout + head.stderr  # how to start one


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--headless"], "--headless runs a follower host's ranks"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "start it with --headless"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "node_rank=2 is outside 0..1"),
        (["-tp", "3", "--nnodes", "2"], "not a multiple of it"),
    ],
)
def test_bad_node_flags_are_refused_before_loading(tiny_model: str, flags: list[str], message: str) -> None:
    result = subprocess.run([*sonar_command(), "serve", tiny_model, *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_pipeline_stages_on_two_hosts_give_one_devices_tokens(tmp_path: Path) -> None:
    """PP=2 over two "hosts": stage 0 on the head (an offline engine), stage 1 (the tied LM
    head, and the sampling) on a ``--headless`` follower; the tokens are one device's."""
    from sonar import LLM, SamplingParams
    from sonar_models.testing import build_tiny_model

    model = str(build_tiny_model("qwen2", tmp_path / "qwen2"))
    engine = dict(kv_cache_memory_bytes=1 << 24, max_model_len=128, max_num_seqs=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3, 4, 5], [9, 8, 7])]
    expected = LLM(model, **engine).generate(prompts, params)
    port = _free_port_pair()
    follower = subprocess.Popen(
        [*sonar_command(), "serve", model, "--kv-cache-memory-bytes", str(1 << 24), "--max-model-len", "128", "--max-num-seqs", "8",
         "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless"],
    )  # fmt: skip
    try:
        llm = LLM(model, pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, **engine)
        got = llm.generate(prompts, params)
        llm.llm_engine.core.executor.shutdown()
        assert follower.wait(30) == 0  # the head's executor shut down: the follower ends cleanly
    finally:
        if follower.poll() is None:
            follower.kill()
    for one, two in zip(expected, got, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            for token_id, logprob in a.items():
                assert b[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)
