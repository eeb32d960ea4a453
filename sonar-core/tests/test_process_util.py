"""The serving processes' heap (frozen once startup is over, young collections made rarer) and
children started by forking."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_freeze_startup_heap_hides_the_startup_objects_and_keeps_collecting_cycles() -> None:
    out = run_python(
        """
        import gc, weakref
        from sonar.engine.process_util import SERVING_GEN0_THRESHOLD, freeze_startup_heap

        class Node:
            pass

        startup = [Node() for _ in range(1000)]
        freeze_startup_heap()
        assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
        assert gc.get_threshold()[0] == SERVING_GEN0_THRESHOLD
        # a cycle made after startup is still found by the collector
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        print("collected" if gone() is None else "leaked")
        """
    )
    assert out.strip() == "collected"


def test_an_engine_in_this_process_freezes_its_startup_heap() -> None:
    """``LLM`` steps the engine core in the caller's process: once it is built, the startup
    heap is frozen as in a core process (full collections walking it paused steps by ~100 ms)."""
    out = run_python(
        """
        import gc
        from sonar.engine.process_util import SERVING_GEN0_THRESHOLD
        from sonar.engine.llm_engine import LLMEngine
        from sonar.config import EngineArgs
        from sonar_models.testing import build_tiny_model
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = build_tiny_model("llama", folder + "/m")
            before = gc.get_freeze_count()
            LLMEngine(EngineArgs(model=str(path), kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True, max_model_len=64))
            print(gc.get_freeze_count() > before + 10000, gc.get_threshold()[0] == SERVING_GEN0_THRESHOLD)
        """
    )
    assert out.split()[-2:] == ["True", "True"]


def test_a_forked_child_runs_its_target_alone_and_exits_with_its_code(tmp_path) -> None:
    """``ForkedProcess``: the child gets its environment and its own session, the descriptor it
    was told to close is closed, only its own exit handlers run (not the temporary-directory
    cleanup or the ``atexit`` hook its parent registered), and the parent reads its exit code,
    a timeout, and a signal's exit as ``subprocess.Popen`` gives them."""
    marks = tmp_path / "marks"
    out = run_python(
        f"""
        import atexit, os, signal, subprocess, tempfile, time
        from sonar.engine.process_util import ForkedProcess, single_threaded

        marks = {str(marks)!r}
        def mark(text):
            with open(marks, "a") as f:
                f.write(text + "\\n")

        kept = tempfile.TemporaryDirectory()  # its cleanup is a weakref.finalize run at exit
        atexit.register(mark, "parent exit")
        held_read, held_write = os.pipe()

        def child():
            atexit.register(mark, "child exit")
            try:
                os.fstat(held_write)
                mark("descriptor open")
            except OSError:
                mark("descriptor closed")
            mark(f"env {{os.environ.get('SONAR_FORK_TEST')}} session {{os.getsid(0) == os.getpid()}}")
            return 3

        print(single_threaded())
        process = ForkedProcess(child, {{"SONAR_FORK_TEST": "yes"}}, close_fds=[held_write])
        print(process.wait(30))
        os.fstat(held_write)  # the parent's copy stays open
        print(os.path.isdir(kept.name))
        sleeper = ForkedProcess(lambda: time.sleep(60) or 0)
        try:
            sleeper.wait(0.2)
        except subprocess.TimeoutExpired:
            print("timed out")
        sleeper.terminate()
        print(sleeper.wait(30), sleeper.poll())
        """
    )
    assert out.split() == ["True", "3", "True", "timed", "out", str(-signal.SIGTERM), str(-signal.SIGTERM)]
    lines = marks.read_text().splitlines()
    assert lines[:3] == ["descriptor closed", "env yes session True", "child exit"]
    assert lines[3:] == ["parent exit"]  # written once, by the parent when it exited


def test_an_offline_engine_forks_its_replicas_and_answers_as_one_process(tmp_path) -> None:
    """``LLM(data_parallel_size=2)`` from a process that has not computed yet starts its
    engine cores by forking on the CPU platform (not as fresh interpreters) and gives the greedy
    tokens of the engine in the caller's process."""
    from sonar_models.testing import build_tiny_model

    path = str(build_tiny_model("llama", tmp_path / "m"))  # here: building computes, which starts torch's threads
    out = run_python(
        f"""
        import json
        from sonar.engine.process_util import ForkedProcess
        from sonar import LLM, SamplingParams

        path = {path!r}
        prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 8, 15, 16, 23], [42]]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        args = dict(kv_cache_memory_bytes=1 << 20, max_model_len=64, skip_tokenizer_init=True)
        replicas = LLM(path, data_parallel_size=2, **args)
        processes = replicas.llm_engine.client.processes.processes
        forked = all(isinstance(p, ForkedProcess) for p in processes)
        got = [o.outputs[0].token_ids for o in replicas.generate([{{"prompt_token_ids": p}} for p in prompts], params)]
        del replicas
        one = LLM(path, **args)
        want = [o.outputs[0].token_ids for o in one.generate([{{"prompt_token_ids": p}} for p in prompts], params)]
        print(json.dumps([forked, got == want, len(processes)]))
        """
    )
    assert out.strip().splitlines()[-1] == "[true, true, 2]"


def test_sonar_worker_multiproc_method_spawn_turns_forking_off(monkeypatch) -> None:
    import pytest

    from sonar.engine.process_util import START_METHOD_ENV, forks_children

    class Forking:
        fork_children = True

    class Spawning:
        fork_children = False

    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert forks_children(Forking) and not forks_children(Spawning)
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert not forks_children(Forking)
    monkeypatch.setenv(START_METHOD_ENV, "Fork")
    assert forks_children(Forking) and not forks_children(Spawning)
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="use 'fork' or 'spawn'"):
        forks_children(Forking)
