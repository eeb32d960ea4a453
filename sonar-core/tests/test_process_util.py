"""The serving processes' heap: frozen once startup is over, young collections made rarer."""

from __future__ import annotations

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
