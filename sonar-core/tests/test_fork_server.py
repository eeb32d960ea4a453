"""Worker ranks forked by a fork server (``sonar.engine.fork_server``): one server per launching
process, ranks that answer like fresh interpreters, exit codes reported, nothing left behind
when the launcher dies, and requests it cannot serve refused without harm."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sonar.engine.fork_server import ForkServer, ForkServerError


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_fork_from_one_server_answer_like_one_device_and_die_with_their_launcher(tmp_path) -> None:
    from sonar_models.testing import build_tiny_model

    path = str(build_tiny_model("llama", tmp_path / "m"))
    code = textwrap.dedent(
        f"""
        import json, os, signal, sys, time
        from sonar import LLM, SamplingParams
        from sonar.engine.fork_server import ForkServer, ForkServerProcess

        args = dict(kv_cache_memory_bytes=1 << 22, max_model_len=64, skip_tokenizer_init=True)
        prompts = [{{"prompt_token_ids": p}} for p in ([1, 2, 3], [9, 8, 7, 6, 5])]
        params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
        one = [o.outputs[0].token_ids for o in LLM({path!r}, **args).generate(prompts, params)]
        ranks, outputs = [], []
        for _ in range(2):
            llm = LLM({path!r}, tensor_parallel_size=2, **args)
            processes = llm.llm_engine.core.executor.processes
            assert all(isinstance(p, ForkServerProcess) for p in processes), processes
            ranks.append([p.pid for p in processes])
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            if len(ranks) == 1:  # a rank killed: its exit status comes back from the server
                victim = processes[1]
                os.kill(victim.pid, signal.SIGKILL)
                print(json.dumps({{"killed": victim.wait(10)}}), flush=True)
            del llm
        server = ForkServer.shared().process.pid
        print(json.dumps({{"server": server, "ranks": ranks, "same": all(o == one for o in outputs)}}), flush=True)
        time.sleep(600)
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [launcher.stdout.readline(), launcher.stdout.readline()]
    finally:
        launcher.kill()
        launcher.wait()
    assert all(lines), launcher.stderr.read()[-3000:]
    killed, report = map(json.loads, lines)
    assert killed == {"killed": -signal.SIGKILL}
    assert report["same"] is True
    assert len({pid for ranks in report["ranks"] for pid in ranks}) == 4  # each engine its own ranks
    left = [report["server"], *report["ranks"][1]]
    deadline = time.monotonic() + 30
    while any(map(_alive, left)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(report["server"]), "the fork server outlived its launcher"
    for pid in report["ranks"][1]:
        assert not _alive(pid), "a rank outlived its launcher"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux only")
def test_a_request_it_cannot_serve_is_refused_and_the_server_serves_on() -> None:
    server = ForkServer()
    try:
        ours, theirs = socket.socketpair()
        with pytest.raises(ForkServerError, match="unknown entry point"):
            server.start("anything-else", ["1"], [theirs.fileno()], dict(os.environ))
        with pytest.raises(ForkServerError, match="unknown entry point"):
            server.start("import os; os.system('id')", [], [theirs.fileno()], dict(os.environ))
        assert server.alive and server.process.poll() is None
        ours.close()
        theirs.close()
    finally:
        server.close()
        assert server.process.wait(10) == 0
