"""The grammar compiler: time limit, bounded cache, shared compilations; no model needed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sonar.structured_output.cache import BoundedCache
from sonar.structured_output.params import GuidedDecodingParams


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from sonar_models.testing import smollm2_tokenizer

    return smollm2_tokenizer()


_made: list[Any] = []


@pytest.fixture(autouse=True)
def shut_compilers_down():
    """Every compiler a test made is shut down after it (its compile processes killed)."""
    yield
    while _made:
        _made.pop().shutdown()


def make_compiler(tokenizer: Any, **kwargs: Any):
    """A compiler whose compile processes are up (a test's timings leave their start out)."""
    from sonar.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, 49152, [2], **kwargs)
    _made.append(compiler)
    compiler.wait_ready()
    return compiler


def many_properties(count: int) -> dict[str, Any]:
    """An object of ``count`` optional bounded strings: xgrammar's compile time grows about
    quadratically with ``count`` (minutes at a few thousand)."""
    return {"type": "object", "properties": {f"property_{i}": {"type": "string", "maxLength": 20} for i in range(count)}}


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def test_the_start_of_a_compile_process_is_not_held_against_a_constraint(tokenizer: Any) -> None:
    """The first constraint of a new compiler waits for a compile process to start (Python,
    xgrammar and the vocabulary: seconds, more on a busy host) and then has its whole time
    limit: a limit shorter than the start refuses nothing that compiles in it."""
    from sonar.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, 49152, [2], compile_timeout_s=1.0)
    _made.append(compiler)
    started = time.monotonic()
    assert compiler.compile(GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})) is not None
    assert time.monotonic() - started > 1.0  # the process's start alone outlasted the limit


def test_cache_is_bounded_in_entries_and_bytes() -> None:
    cache: BoundedCache[str] = BoundedCache(max_entries=3, max_bytes=100)
    for i in range(5):
        cache.put(i, f"v{i}", 10)
    assert cache.num_entries == 3 and cache.get(0) is None and cache.get(4) == "v4"
    cache.get(2)  # recently used: survives the next evictions
    cache.put("big", "b", 85)
    assert cache.num_bytes <= 100 and cache.get(2) == "v2" and cache.get("big") == "b"
    cache.put("huge", "h", 101)  # larger than the whole cache: not kept
    assert cache.get("huge") is None and cache.num_bytes <= 100


def test_ten_thousand_distinct_schemas_stay_within_the_cache_bound(tokenizer: Any) -> None:
    max_bytes = 2 * 1024 * 1024
    compiler = make_compiler(tokenizer, max_cache_entries=256, max_cache_bytes=max_bytes)
    started = time.perf_counter()
    for i in range(10_000):
        compiler.compile(GuidedDecodingParams(json={"type": "object", "properties": {"id": {"const": i}}, "required": ["id"]}))
        assert compiler.cache.num_entries <= 256 and compiler.cache.num_bytes <= max_bytes
    assert compiler.cache.num_evictions >= 10_000 - 256
    assert time.perf_counter() - started < 240  # about 25 s alone on 2 cores: a guard against superlinear work, not a timing


def test_slow_compilation_times_out_with_a_clear_error(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="did not compile within 0.01 s"):
        compiler.compile(GuidedDecodingParams(json=nested_schema(60)), timeout_s=0.01)
    assert time.perf_counter() - started < 1.0
    assert compiler.compile(GuidedDecodingParams(regex="(a+)+$")) is not None  # the compiler still serves


def test_a_compilation_past_the_limit_is_killed_and_its_capacity_comes_back(tokenizer: Any) -> None:
    """A valid constraint that compiles for seconds, with one compile process and a limit of
    0.5 s: the request is refused at the limit, the process compiling it is killed, and the
    next constraint compiles in a new process at once instead of waiting seconds behind it."""
    started = time.perf_counter()
    compiler = make_compiler(tokenizer, compile_timeout_s=0.5, num_threads=1)
    process_start_s = time.perf_counter() - started  # what a replacement's start costs on this machine, at most
    (first,) = compiler._workers
    started = time.perf_counter()
    with pytest.raises(ValueError, match="did not compile within 0.5 s"):
        compiler.compile(GuidedDecodingParams(json=many_properties(3000)))
    assert compiler.compile(GuidedDecodingParams(regex="[a-z]+"), timeout_s=60) is not None  # in the replacement process
    elapsed = time.perf_counter() - started
    assert first.process.poll() is not None  # killed (and reaped)
    (second,) = compiler._workers  # the killed one is no longer held
    assert second is not first and second.alive
    # the slow one alone compiles for minutes; the next one waits for the limit and a new process's start
    limit = 0.5 + 2 * process_start_s + 1.0
    assert elapsed < limit, f"the next constraint waited {elapsed:.1f} s (limit and a process start: {limit:.1f} s)"


def test_pathological_inputs_are_refused_or_fast(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer)
    started = time.perf_counter()
    for regex in ["(a+)+$", "(a|aa)*b", "((a*)*)*c", "(x{1,100}){1,100}"]:
        compiler.compile(GuidedDecodingParams(regex=regex))
    assert time.perf_counter() - started < 2.0
    with pytest.raises(ValueError, match="nests deeper"):
        GuidedDecodingParams(json=nested_schema(1000))


def test_same_constraint_compiles_once_across_threads(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer)
    params = GuidedDecodingParams(json=nested_schema(30))
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(params))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert compiler.cache.num_entries == 1


def test_a_grammar_that_matches_no_text_is_refused(tokenizer: Any) -> None:
    """An empty language would mask every logit; an endless one (max_tokens ends it) compiles."""
    compiler = make_compiler(tokenizer)
    try:
        with pytest.raises(ValueError, match="matches no text"):
            compiler.compile(GuidedDecodingParams(grammar="root ::= root"))
        assert compiler.cache.num_entries == 0
        assert compiler.compile(GuidedDecodingParams(grammar='root ::= "a" root')) is not None
    finally:
        compiler.shutdown()
