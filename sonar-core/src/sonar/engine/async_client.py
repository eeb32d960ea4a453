"""The async engine client: the engine's step loop in its own thread, requests added, streamed
and aborted from an asyncio event loop.

The event loop never runs a step and the step loop never waits on the event loop: commands
cross over through locked queues, outputs come back with ``loop.call_soon_threadsafe``. Outputs
are cumulative, so a slow consumer only ever sees the newest one (older ones are dropped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sonar.lora.errors import LoRAError
from sonar.lora.request import LoRARequest
from sonar.outputs import RequestOutput
from sonar.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sonar.config import EngineArgs

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


class QueueFull(RuntimeError):
    """Too many requests are waiting for a slot; try again later."""


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; every request fails until the process restarts."""


class EngineClosedError(RuntimeError):
    """The client was shut down and takes no new requests."""


@dataclass(slots=True)
class _AddCommand:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    done: concurrent.futures.Future[None]
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _LoRACommand:
    method: str  # "add", "remove", "list"
    argument: Any  # a LoRARequest, an adapter id, or None
    done: concurrent.futures.Future[Any]


class RequestStream:
    """The outputs of one request, newest first-come: ``async for output in stream``.

    Closing it (``await stream.aclose()``) before the request finished aborts the request.
    """

    def __init__(self, request_id: str, client: AsyncLLM, delta: bool = False) -> None:
        self.request_id = request_id
        self.finished = False
        self._client = client
        # cumulative outputs: only the newest not yet taken is kept; deltas (``delta``) not yet
        # taken are folded into one. A finished output or an error is the last, and nothing
        # put after it replaces it
        self._delta = delta
        self._pending: RequestOutput | BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if pending is not None and (isinstance(pending, BaseException) or pending.finished):
            return
        if self._delta and pending is not None and not isinstance(item, BaseException):
            pending.add(item)
        else:
            self._pending = item
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        """Stop streaming; aborts the request (freeing its KV blocks) if it has not finished."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class AsyncLLM:
    """Runs an ``LLMEngine`` step loop in a background thread and serves it to asyncio code.

    :param engine: an ``LLMEngine`` (anything with ``add_request(request_id, prompt, params,
        priority=0)``, ``abort_request``, ``step``, ``has_unfinished_requests`` and
        ``get_stats``).
    :param max_in_flight: requests admitted at once (running plus waiting); one more raises
        ``QueueFull``. None: unbounded.
    """

    def __init__(self, engine: Any, max_in_flight: int | None = None) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.model_config = getattr(engine, "model_config", None)
        self._streams: dict[str, RequestStream] = {}
        self._stream_loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._adds: list[_AddCommand] = []
        self._aborts: list[str] = []
        self._lora_commands: list[_LoRACommand] = []
        self._pending_removals: list[tuple[int, concurrent.futures.Future[Any]]] = []  # removals waiting for their requests
        self._wakeup = threading.Condition()
        self._stopping = False
        self._dead_error: EngineDeadError | None = None
        self._stats: Any = self._read_stats()
        self._thread = threading.Thread(target=self._run, name="sonar-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, max_in_flight: int | None = None) -> AsyncLLM:
        """Build the engine (loading the model) and start its step loop."""
        from sonar.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args), max_in_flight=max_in_flight)

    # -- requests ------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, lora_request: LoRARequest | None = None
    ) -> RequestStream:
        """Hand a request to the engine and return its output stream (``priority``: lower runs
        first, with the priority scheduling policy; ``lora_request``: the LoRA adapter it runs
        with, added first where the engine does not serve it yet).

        A string prompt is tokenized here, in a worker thread, not in the step loop.

        :raises ValueError: the engine rejected the request (the message says why).
        :raises LoRAError: its adapter cannot be served.
        :raises QueueFull: ``max_in_flight`` requests are already admitted.
        :raises EngineDeadError: the step loop has failed.
        """
        self._check_accepting()
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) and self.tokenizer is not None:
            text = prompt
            token_ids = await loop.run_in_executor(None, self.encode, text)
            prompt = {"prompt_token_ids": token_ids, "prompt": text}
        compile_grammar = getattr(self.engine, "compile_grammar", None)
        if params.guided_decoding is not None and compile_grammar is not None:  # structured output, off the step loop
            await loop.run_in_executor(None, compile_grammar, params)
        stream = RequestStream(request_id, self, delta=params.output_kind == "delta")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._wakeup:
            self._check_accepting()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self.max_in_flight is not None and len(self._streams) >= self.max_in_flight:
                raise QueueFull(f"{len(self._streams)} requests are in flight, the limit is {self.max_in_flight}; retry later")
            self._streams[request_id] = stream
            self._stream_loops[request_id] = loop
            self._adds.append(_AddCommand(request_id, prompt, params, done, priority, lora_request))
            self._wakeup.notify()
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, lora_request: LoRARequest | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative, or as ``params.output_kind`` says); stopping
        early (or being cancelled, as when an HTTP client disconnects) aborts it.
        ``lora_request``: as ``add_request``."""
        stream = await self.add_request(request_id, prompt, params, priority, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends and its KV blocks are freed."""
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    # -- LoRA adapters -------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Serve a LoRA adapter (read and checked in the step loop's thread, between steps);
        adding one already served is a no-op.

        :raises LoRAError: it cannot be served (the engine's message says why).
        """
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        await self._lora_command("add", lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Stop serving an adapter. One that running or waiting requests use takes no new
        requests and is dropped once they have finished; this returns then.

        :raises LoRAError: no adapter with that id is served.
        """
        if not await self._lora_command("remove", lora_int_id):
            raise LoRAError(f"no LoRA adapter with lora_int_id {lora_int_id} is served")

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters served (those being removed left out), by id."""
        return await self._lora_command("list", None)

    async def _lora_command(self, method: str, argument: Any) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._wakeup:
            self._check_accepting()
            self._lora_commands.append(_LoRACommand(method, argument, done))
            self._wakeup.notify()
        return await asyncio.wrap_future(done)

    def abort_all(self) -> None:
        with self._wakeup:
            self._aborts.extend(self._streams)
            self._wakeup.notify()

    async def get_tokenizer(self) -> Any:
        """The tokenizer requests are encoded and decoded with (vLLM's ``AsyncLLM`` method)."""
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, exactly as the engine would tokenize it."""
        encode = getattr(self.engine, "encode", None)
        if encode is not None:
            return list(encode(text))
        return list(self.tokenizer.encode(text))

    # -- state ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        with self._wakeup:
            return len(self._streams)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def is_healthy(self) -> bool:
        return self._dead_error is None and self._thread.is_alive()

    def get_stats(self) -> Any:
        """The engine's statistics as of the end of its latest loop iteration."""
        return self._stats

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is left and stop the step loop."""
        with self._wakeup:
            self._aborts.extend(self._streams)
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout)

    def _check_accepting(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._stopping:
            raise EngineClosedError("the engine is shutting down")

    # -- the step loop (engine thread) ---------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not (
                        self._adds or self._aborts or self._lora_commands or self._stopping or self.engine.has_unfinished_requests()
                    ):
                        self._wakeup.wait()
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    lora_commands, self._lora_commands = self._lora_commands, []
                    stopping = self._stopping
                self._apply_aborts(aborts)
                if stopping:
                    self._fail_all(EngineClosedError("the engine shut down"))
                    return
                for command in adds:  # before LoRA calls: a removal then waits for requests sent before it
                    self._apply_add(command)
                for lora_command in lora_commands:
                    self._apply_lora(lora_command)
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output)
                self._answer_removals()
                self._stats = self._read_stats()
        except BaseException as exc:  # the step loop is dead: fail everything, loudly
            logger.error("engine step loop failed:\n%s", "".join(traceback.format_exception(exc)))
            self._dead_error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            self._fail_all(self._dead_error)

    def _apply_add(self, command: _AddCommand) -> None:
        with self._wakeup:
            if command.request_id not in self._streams:  # aborted before it was added
                command.done.set_result(None)
                return
        try:
            if command.lora_request is not None:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, priority=command.priority, lora_request=command.lora_request
                )
            else:
                self.engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority)
        except Exception as exc:  # bad input (ValueError): the caller gets it, the loop lives on
            self._forget(command.request_id)
            command.done.set_exception(exc)
            return
        command.done.set_result(None)

    def _apply_lora(self, command: _LoRACommand) -> None:
        engine = self.engine
        try:
            if command.method == "add":
                result: Any = engine.add_lora(command.argument)
            elif command.method == "remove":
                result = engine.remove_lora(command.argument)
                if result and engine.lora_removal_pending(command.argument):  # answered once its requests finish
                    self._pending_removals.append((command.argument, command.done))
                    return
            else:
                result = engine.get_loras()
        except Exception as exc:  # a bad adapter (LoRAError): the caller gets it, the loop lives on
            command.done.set_exception(exc)
            return
        command.done.set_result(result)

    def _answer_removals(self) -> None:
        if not self._pending_removals:
            return
        pending = []
        for lora_int_id, done in self._pending_removals:
            if self.engine.lora_removal_pending(lora_int_id):
                pending.append((lora_int_id, done))
            else:
                done.set_result(True)
        self._pending_removals = pending

    def _apply_aborts(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        final_outputs = {output.request_id: output for output in self.engine.abort_request(list(request_ids)) or ()}
        for request_id in request_ids:
            stream_and_loop = self._forget(request_id)
            if stream_and_loop is not None:
                stream, loop = stream_and_loop
                _call_soon(loop, stream.put, final_outputs.get(request_id) or _aborted_output(request_id))

    def _deliver(self, output: RequestOutput) -> None:
        with self._wakeup:
            stream = self._streams.get(output.request_id)
            loop = self._stream_loops.get(output.request_id)
        if stream is None or loop is None:
            return
        if output.finished:
            self._forget(output.request_id)
        _call_soon(loop, stream.put, output)

    def _forget(self, request_id: str) -> tuple[RequestStream, asyncio.AbstractEventLoop] | None:
        with self._wakeup:
            stream = self._streams.pop(request_id, None)
            loop = self._stream_loops.pop(request_id, None)
        if stream is None or loop is None:
            return None
        return stream, loop

    def _fail_all(self, error: BaseException) -> None:
        with self._wakeup:
            adds, self._adds = self._adds, []
            lora_commands, self._lora_commands = self._lora_commands, []
            streams = list(self._streams.items())
            self._streams.clear()
            loops, self._stream_loops = self._stream_loops, {}
        for command in adds:
            if not command.done.done():
                command.done.set_exception(error)
        for done in [c.done for c in lora_commands] + [done for _, done in self._pending_removals]:
            if not done.done():
                done.set_exception(error)
        self._pending_removals = []
        for request_id, stream in streams:
            _call_soon(loops[request_id], stream.put, error)

    def _read_stats(self) -> Any:
        get_stats = getattr(self.engine, "get_stats", None)
        return get_stats() if get_stats is not None else None


def _aborted_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None, outputs=[], finished=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
