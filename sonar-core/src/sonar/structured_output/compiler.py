"""Grammar compilation with xgrammar: in a thread pool, under a time limit, behind a cache
bounded in entries and bytes. One compiler per model (its tokenizer's vocabulary)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections.abc import Hashable
from typing import Any

import xgrammar as xgr

from sonar.structured_output.cache import BoundedCache
from sonar.structured_output.params import GuidedDecodingParams

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 512
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILE_THREADS = 2
# xgrammar writes the characters of a length-bounded JSON string as this class, which admits
# control characters JSON forbids; swapped for the class its unbounded strings use
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def _clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    return _XGRAMMAR_LOCATION.sub("", str(exc)).strip() or type(exc).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class GrammarCompiler:
    """Compiles ``GuidedDecodingParams`` into xgrammar grammars for one tokenizer.

    ``compile`` is thread-safe and may be called from any thread; equal constraints compile
    once (concurrent requests for the same one wait on the same compilation).

    :param tokenizer: the model's Hugging Face tokenizer.
    :param vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
    :param stop_token_ids: the tokens that end a request (the model's EOS tokens).
    :param max_cache_entries: compiled grammars kept.
    :param max_cache_bytes: bytes of compiled grammars kept.
    :param compile_timeout_s: a grammar that takes longer is refused (ValueError).
    :param num_threads: compilations that run at once.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_cache_entries: int = DEFAULT_CACHE_ENTRIES,
        max_cache_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        num_threads: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_in_flight = 4 * num_threads
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_threads, cache_enabled=False)
        self.cache: BoundedCache[xgr.CompiledGrammar] = BoundedCache(max_cache_entries, max_cache_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="sonar-grammar")
        self._in_flight: dict[Hashable, concurrent.futures.Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()

    def compile(self, params: GuidedDecodingParams, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``, from the cache when it is there.

        :param timeout_s: seconds to wait (default: the compiler's ``compile_timeout_s``).
        :raises ValueError: the constraint is invalid, or did not compile in time (a
            compilation that timed out keeps running and is cached if it ever finishes).
        """
        key = params.cache_key()
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            future = self._in_flight.get(key)
            if future is None:
                if len(self._in_flight) >= self.max_in_flight:
                    raise ValueError(f"{len(self._in_flight)} grammars are already compiling; retry later")
                future = self._pool.submit(self._compile_into_cache, key, params)
                self._in_flight[key] = future
        timeout = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"the {params.kind} constraint did not compile within {timeout:g} s; simplify it"
            ) from None
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise ValueError(f"invalid guided_{params.kind}: {_clean_error(exc)}") from None

    def _compile_into_cache(self, key: Hashable, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(params)
            self._check_opens(compiled)
            self.cache.put(key, compiled, compiled.memory_size_bytes)
            return compiled
        finally:
            with self._lock:
                self._in_flight.pop(key, None)

    def _check_opens(self, compiled: xgr.CompiledGrammar) -> None:
        """Refuse a grammar that allows no first token (its language is empty, as with
        ``root ::= root``, or no token spells its start): every logit would be masked."""
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not matcher.is_terminated() and not bool(bitmask.any()):
            raise ValueError("the constraint matches no text this model's tokens can write")

    def _compile(self, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        kind = params.kind
        if kind == "json":
            return self._compile_json(json.dumps(params.json), strict=True)
        if kind == "json_object":
            return self._compile_json('{"type": "object"}', strict=False)
        if kind == "regex":
            return self._xgr.compile_regex(params.regex)
        if kind == "choice":
            return self._xgr.compile_grammar(choice_grammar(params.choice))
        return self._xgr.compile_grammar(params.grammar)

    def _compile_json(self, schema: str, strict: bool) -> xgr.CompiledGrammar:
        # compact JSON: free whitespace would let a model pad forever
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
        text = str(grammar)
        if _LENGTH_BOUNDED_CHAR in text:  # that class lets raw control characters into strings
            return self._xgr.compile_grammar(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))
        return self._xgr.compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- one compiler per model in this process --------------------------------------------------

_compilers: dict[str, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def get_grammar_compiler(model: str, tokenizer: Any = None, vocab_size: int = 0, stop_token_ids: list[int] | None = None) -> GrammarCompiler:
    """The process's compiler for ``model`` (a model path), made on first use.

    The engine makes it (it holds the tokenizer); a model runner in the same process gets the
    same one, so grammars compiled when a request was added are cache hits when it runs.
    A runner in another process passes the tokenizer it loaded itself.
    """
    with _compilers_lock:
        compiler = _compilers.get(model)
        if compiler is None:
            if tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer (the engine was started with skip_tokenizer_init)")
            compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids or [])
            _compilers[model] = compiler
        return compiler
