"""The asyncio frontend of engine-core processes: what one API server process runs.

Requests are tokenized, validated and fanned out here (input processor), sent to the least
loaded live engine core, and their outputs detokenized here, on the event loop (output
processor); a stop string found here aborts the engine-core side. Engine cores that die fail
only their own requests; when none is left, every request fails with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sonar.config import EngineConfig
from sonar.engine.async_client import AsyncLLM, EngineClosedError, EngineDeadError, QueueFull, RequestStream, _aborted_output, _call_soon
from sonar.engine.core_client import MPCoreClient, lora_reply_result
from sonar.engine.input_processor import InputProcessor, PromptType
from sonar.engine.output_processor import OutputProcessor
from sonar.engine.wire import ClientAddresses, EngineCoreOutputs, LoRAReply, SchedulerStats, rejection
from sonar.lora.errors import LoRAError
from sonar.lora.request import LoRARequest
from sonar.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncMPLLM:
    """Serves engine-core processes to asyncio code, with ``AsyncLLM``'s interface.

    :param config: the engine configuration every engine core runs.
    :param tokenizer: the model's tokenizer (None with ``skip_tokenizer_init``).
    :param addresses: this frontend's two sockets (it binds them).
    :param client_index: this frontend's index (engine cores route its outputs by it).
    :param max_in_flight: requests admitted at once; one more raises ``QueueFull``.
    :param engine_step_timeout: a step running longer than this counts as a stuck engine.
    :param check_started: raises while waiting for the engines if one has exited.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        addresses: ClientAddresses,
        client_index: int = 0,
        max_in_flight: int | None = None,
        engine_step_timeout: float = 60.0,
        check_started: Any = None,
    ) -> None:
        self.config = config
        self.model_config = config
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.engine_step_timeout = engine_step_timeout
        self.input_processor = InputProcessor(config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._engine_of: dict[str, int] = {}  # request id -> the engine core running it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._dead_error: EngineDeadError | None = None
        self._served_loras: dict[int, LoRARequest] = {}  # adapters this frontend added or listed (skips re-adding per request)
        self.client = MPCoreClient(
            addresses, client_index, config.data_parallel_size, self._outputs_arrived, self._engine_died, check_started
        )

    # -- requests ------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0, lora_request: LoRARequest | None = None
    ) -> RequestStream:
        """Hand a request to an engine core and return its output stream; ``lora_request``
        names the LoRA adapter it runs with (added to every engine core first where this
        frontend has not seen it served).

        :raises ValueError: the request is invalid (the message says why).
        :raises LoRAError: its adapter cannot be served.
        :raises QueueFull: ``max_in_flight`` requests are already admitted.
        :raises EngineDeadError: no engine core is alive.
        """
        self._check_accepting()
        loop = self._bind_loop()
        self.input_processor.check_lora(lora_request)
        if lora_request is not None and self._served_loras.get(lora_request.lora_int_id) != lora_request:
            await self.add_lora(lora_request)
        processed = await loop.run_in_executor(
            None, self.input_processor.process, request_id, prompt, params, self.client.client_index, priority, lora_request
        )
        self._check_accepting()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_in_flight is not None and len(self._streams) >= self.max_in_flight:
            raise QueueFull(f"{len(self._streams)} requests are in flight, the limit is {self.max_in_flight}; retry later")
        engine = self.client.choose_engine(avoid=set(self.client.stuck_engines(self.engine_step_timeout)))
        stream = RequestStream(request_id, self, delta=processed.params.output_kind == "delta")  # type: ignore[arg-type]
        self.output_processor.add(
            request_id, processed.prompt, processed.prompt_token_ids, processed.params, processed.child_ids, processed.child_params
        )
        self._streams[request_id] = stream
        self._engine_of[request_id] = engine
        self.client.add(engine, processed.core_requests)
        return stream

    generate = AsyncLLM.generate  # streams ``add_request``'s outputs (``lora_request`` too); stopping early aborts

    # -- LoRA adapters -------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Serve a LoRA adapter in every engine core (each reads and checks it between its
        steps); adding one already served is a no-op.

        :raises LoRAError: it cannot be served (an engine core's message says why).
        """
        self.input_processor.check_lora(lora_request)
        lora_reply_result(await self._call_everywhere("add", lora_request=lora_request))
        self._served_loras[lora_request.lora_int_id] = lora_request

    async def remove_lora(self, lora_int_id: int) -> None:
        """Stop serving an adapter in every engine core. One that running or waiting requests
        use takes no new requests and is dropped once they have finished; this returns when
        every engine core has dropped it.

        :raises LoRAError: no engine core serves an adapter with that id.
        """
        self._served_loras.pop(lora_int_id, None)
        if not lora_reply_result(await self._call_everywhere("remove", lora_int_id=lora_int_id)):
            raise LoRAError(f"no LoRA adapter with lora_int_id {lora_int_id} is served")

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine cores serve (they all serve the same), by id. Another API
        server may have changed them: ``get_stats().lora_registry_version`` changes then."""
        self._bind_loop()
        engine = self.client.choose_engine()
        reply = await asyncio.wrap_future(self.client.call_lora(engine, "list"))
        lora_reply_result([reply])
        self._served_loras = {r.lora_int_id: r for r in reply.loras}
        return list(reply.loras)

    async def _call_everywhere(self, method: str, **kwargs: Any) -> list[LoRAReply]:
        self._check_accepting()
        self._bind_loop()
        futures = self.client.call_lora_everywhere(method, **kwargs)
        if not futures:
            raise EngineDeadError("no engine core is alive")
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends and its KV blocks are freed."""
        loop = self._loop
        if loop is None:
            return
        if _on_loop(loop):
            self._abort(request_id)
        else:
            _call_soon(loop, self._abort, request_id)

    def abort_all(self) -> None:
        loop = self._loop
        if loop is None:
            return
        _call_soon(loop, lambda: [self._abort(r) for r in list(self._streams)])

    async def get_tokenizer(self) -> Any:
        """The tokenizer requests are encoded and decoded with (vLLM's ``AsyncLLM`` method)."""
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, exactly as the engine would tokenize it."""
        return self.input_processor.encode(text)

    # -- state ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def is_healthy(self) -> bool:
        return self.health()["status"] == "ok"

    def health(self) -> dict[str, Any]:
        """``status``: ok, degraded (some replicas dead or stuck, others serving) or dead;
        and each engine core's state."""
        stuck = set(self.client.stuck_engines(self.engine_step_timeout))
        engines = []
        for engine in self.client.engines:
            state = "dead" if not engine.alive else "stuck" if engine.index in stuck else "ok"
            entry: dict[str, Any] = {"index": engine.index, "state": state}
            if engine.error:
                entry["error"] = engine.error
            if state == "stuck":
                entry["error"] = f"a step has run for {engine.step_elapsed_s:.0f}s (--engine-step-timeout {self.engine_step_timeout:g}s)"
            engines.append(entry)
        serving = sum(e["state"] == "ok" for e in engines)
        status = "ok" if serving == len(engines) else "degraded" if serving else "dead"
        return {"status": status, "engines": engines}

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is left and close the sockets (the engine cores are stopped by whoever
        started them)."""
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for request_id in list(self._streams):
                stream = self._streams.pop(request_id)
                _call_soon(loop, stream.put, EngineClosedError("the engine shut down"))
        self.client.close()

    def _check_accepting(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._stopping:
            raise EngineClosedError("the engine is shutting down")

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncMPLLM serves one event loop")
        return loop

    # -- outputs (event loop) ------------------------------------------------------------

    def _outputs_arrived(self, outputs: EngineCoreOutputs) -> None:  # receiver thread
        loop = self._loop
        if loop is not None:
            _call_soon(loop, self._process, outputs)

    def _process(self, outputs: EngineCoreOutputs) -> None:
        request_outputs, to_stop = self.output_processor.process(outputs.outputs)
        for output in request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                self._streams.pop(output.request_id, None)
                self._engine_of.pop(output.request_id, None)
                refused = rejection(output.outputs[0].stop_reason) if output.outputs and not output.outputs[0].token_ids else None
                if refused is not None:  # the engine core refused it: an error, not an empty answer
                    stream.put(refused)
                    continue
            stream.put(output)
        if to_stop:  # stop strings found here: the engine core lets these go
            self.client.abort(outputs.engine_index, [child_id for child_id, _ in to_stop])

    def _abort(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        child_ids = self.output_processor.child_ids(request_id)
        if engine is not None:
            self.client.abort(engine, child_ids)
        final = self.output_processor.abort(request_id)
        if stream is not None:
            stream.put(final or _aborted_output(request_id))

    def _engine_died(self, index: int, reason: str) -> None:  # receiver thread
        if self.client.num_alive == 0:
            self._dead_error = EngineDeadError(f"the engine failed: engine core {index}: {reason}")
        loop = self._loop
        if loop is not None:
            _call_soon(loop, self._fail_engine, index, reason)

    def _fail_engine(self, index: int, reason: str) -> None:
        error = EngineDeadError(f"the engine core running this request failed: {reason}")
        for request_id, engine in list(self._engine_of.items()):
            if engine != index:
                continue
            del self._engine_of[request_id]
            self.output_processor.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

