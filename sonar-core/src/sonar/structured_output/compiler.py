"""Grammar compilation with xgrammar: tried first in processes of their own under a time limit
(a trial past it is killed with its process, see ``compile_worker``), then compiled in a thread
pool, behind a cache bounded in entries and bytes. One compiler per model (its tokenizer's
vocabulary)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
from collections.abc import Hashable
from typing import Any

import xgrammar as xgr

from sonar.structured_output.cache import BoundedCache
from sonar.structured_output.compile_worker import CompileTimeout, CompileWorker, choice_grammar, clean_error, compile_constraint
from sonar.structured_output.params import GuidedDecodingParams

__all__ = ["GrammarCompiler", "choice_grammar", "get_grammar_compiler"]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 512
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILE_THREADS = 2
#: how long a constraint may wait for its compilation to begin (a compile thread and process
#: free, a process started), on top of its time limit
START_WAIT_S = 120.0


def wire_request(params: GuidedDecodingParams) -> dict[str, Any]:
    """``params`` as a compile process takes it (``compile_worker.compile_constraint``)."""
    kind = params.kind
    if kind == "json":
        return {"kind": kind, "spec": json.dumps(params.json)}
    if kind == "json_object":
        return {"kind": kind}
    return {"kind": kind, "spec": getattr(params, kind)}


class GrammarCompiler:
    """Compiles ``GuidedDecodingParams`` into xgrammar grammars for one tokenizer.

    ``compile`` is thread-safe and may be called from any thread; equal constraints compile
    once (concurrent requests for the same one wait on the same compilation). Where
    ``isolate``, each new constraint is first compiled in one of ``num_threads`` compile
    processes (started with the compiler, in the background): a trial that outlasts
    ``compile_timeout_s`` is killed with its process, and a new process takes its place, so a
    constraint that compiles for minutes holds no capacity past its time limit (which runs from
    when its compilation begins: waiting for a thread, or for a process to start, is not held
    against it). One that compiles in time is compiled again in a thread here (xgrammar's
    compiled grammars are too large to pass between processes); without ``isolate`` (an engine core in its own process,
    whose frontends tried every constraint first) only that.

    :param tokenizer: the model's Hugging Face tokenizer.
    :param vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
    :param stop_token_ids: the tokens that end a request (the model's EOS tokens).
    :param max_cache_entries: compiled grammars kept.
    :param max_cache_bytes: bytes of compiled grammars kept.
    :param compile_timeout_s: a grammar that takes longer is refused (ValueError).
    :param num_threads: compilations that run at once.
    :param isolate: try each constraint in a compile process first.
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
        isolate: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_in_flight = 4 * num_threads
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=num_threads, cache_enabled=False)
        self.isolate = isolate
        self.cache: BoundedCache[xgr.CompiledGrammar] = BoundedCache(max_cache_entries, max_cache_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="sonar-grammar")
        # a compilation in progress, and whether it has begun (past its queue and its process's start)
        self._in_flight: dict[Hashable, tuple[concurrent.futures.Future[xgr.CompiledGrammar], threading.Event]] = {}
        self._lock = threading.Lock()
        self._info_json = self.tokenizer_info.serialize_json()
        self._num_threads = num_threads
        self._idle: queue.Queue[CompileWorker | None] = queue.Queue()  # None: a worker still to start
        self._workers: list[CompileWorker] = []  # the processes running, for shutdown
        self._closed = False
        for _ in range(num_threads):
            self._idle.put(None)
        for _ in range(num_threads if isolate else 0):  # started while the engine starts: the first request finds them up
            self._pool.submit(self._warm_one)

    def compile(self, params: GuidedDecodingParams, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``, from the cache when it is there.

        :param timeout_s: seconds to wait once the compilation has begun (default: the
            compiler's ``compile_timeout_s``); before that, up to ``START_WAIT_S`` for a free
            compile thread and a started compile process.
        :raises ValueError: the constraint is invalid, or did not compile in time. A trial
            still running after the compiler's ``compile_timeout_s`` is killed; a compilation
            a caller stopped waiting for sooner (a shorter ``timeout_s``) goes on within that
            limit and is cached if it finishes.
        """
        key = params.cache_key()
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            entry = self._in_flight.get(key)
            if entry is None:
                if len(self._in_flight) >= self.max_in_flight:
                    raise ValueError(f"{len(self._in_flight)} grammars are already compiling; retry later")
                began = threading.Event()
                future = self._pool.submit(self._compile_into_cache, key, params, began)
                future.add_done_callback(lambda _: began.set())  # one that failed before it began wakes its waiters too
                entry = self._in_flight[key] = (future, began)
        future, began = entry
        if not began.wait(START_WAIT_S):
            raise ValueError(f"the {params.kind} constraint's compilation did not begin within {START_WAIT_S:g} s (the compiler is busy); retry later")
        timeout = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout)
        except (concurrent.futures.TimeoutError, CompileTimeout):  # waited too long, or its process was killed
            timeout = min(timeout, self.compile_timeout_s)
            raise ValueError(
                f"the {params.kind} constraint did not compile within {timeout:g} s; simplify it"
            ) from None
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise ValueError(f"invalid guided_{params.kind}: {clean_error(exc)}") from None

    def wait_ready(self) -> None:
        """Return once every compile process has started (they start in the background with
        the compiler; a compilation meanwhile waits for one); at once without ``isolate``."""
        if not self.isolate:
            return
        workers = [self._idle.get() for _ in range(self._num_threads)]
        try:
            for i, worker in enumerate(workers):
                if (worker is None or not worker.alive) and not self._closed:
                    workers[i] = self._start_worker()
                if workers[i] is not None:
                    workers[i].wait_started()
        finally:
            for worker in workers:
                self._idle.put(worker)

    def _warm_one(self) -> None:
        """Start a compile process where one is still to start, and give it back idle once it
        is ready (or dead: the next trial starts another)."""
        worker = self._idle.get()
        try:
            if worker is None and not self._closed:
                worker = self._start_worker()
                worker.wait_started()
        except RuntimeError as exc:
            logger.warning("a grammar compile process failed to start: %s", exc)
        finally:
            self._idle.put(worker)

    def _start_worker(self) -> CompileWorker:
        worker = CompileWorker(self._info_json, self._num_threads)
        with self._lock:
            self._workers = [w for w in self._workers if w.alive] + [worker]  # killed ones are reaped already
        return worker

    def _compile_into_cache(self, key: Hashable, params: GuidedDecodingParams, began: threading.Event) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile(params, began)
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

    def _compile(self, params: GuidedDecodingParams, began: threading.Event) -> xgr.CompiledGrammar:
        """``params`` compiled here, after a trial in a compile process where ``isolate``
        (``began`` set once the compilation itself begins)."""
        request = wire_request(params)
        if self.isolate:
            self._trial(params, request, began)
        began.set()
        return compile_constraint(self._xgr, request)

    def _trial(self, params: GuidedDecodingParams, request: dict[str, Any], began: threading.Event) -> None:
        """Compile ``request`` in an idle compile process (waiting for one, and for its start),
        which is killed, and replaced, where the trial outlasts ``compile_timeout_s``; ``began``
        is set as the trial begins.

        :raises CompileTimeout: it did; RuntimeError: it does not compile."""
        worker = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            if worker is None or not worker.alive:
                worker = self._start_worker()
            worker.wait_started()
            began.set()
            worker.compile(request, self.compile_timeout_s)
        except CompileTimeout:
            worker = None
            logger.warning("a guided_%s constraint compiled for more than %g s: its compile process was killed", params.kind, self.compile_timeout_s)
            raise
        except RuntimeError:
            if worker is not None and not worker.alive:
                worker = None
            raise
        finally:
            self._idle.put(worker)
            if worker is None and not self._closed:  # its replacement starts now, not with the next request
                try:
                    self._pool.submit(self._warm_one)
                except RuntimeError:  # shut down meanwhile
                    pass

    def shutdown(self) -> None:
        """Stop compiling: queued compilations are dropped and every compile process is killed."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()


# -- one compiler per model in this process --------------------------------------------------

_compilers: dict[str, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def get_grammar_compiler(
    model: str, tokenizer: Any = None, vocab_size: int = 0, stop_token_ids: list[int] | None = None, isolate: bool = True
) -> GrammarCompiler:
    """The process's compiler for ``model`` (a model path), made on first use (``isolate``: see
    ``GrammarCompiler``).

    The engine makes it (it holds the tokenizer); a model runner in the same process gets the
    same one, so grammars compiled when a request was added are cache hits when it runs.
    A runner in another process passes the tokenizer it loaded itself.
    """
    with _compilers_lock:
        compiler = _compilers.get(model)
        if compiler is None:
            if tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer (the engine was started with skip_tokenizer_init)")
            compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids or [], isolate=isolate)
            _compilers[model] = compiler
        return compiler
