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


def make_compiler(tokenizer: Any, **kwargs: Any):
    from sonar.structured_output.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, 49152, [2], **kwargs)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


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
    assert time.perf_counter() - started < 60


def test_slow_compilation_times_out_with_a_clear_error(tokenizer: Any) -> None:
    compiler = make_compiler(tokenizer)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="did not compile within 0.01 s"):
        compiler.compile(GuidedDecodingParams(json=nested_schema(60)), timeout_s=0.01)
    assert time.perf_counter() - started < 1.0
    assert compiler.compile(GuidedDecodingParams(regex="(a+)+$")) is not None  # the compiler still serves


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
