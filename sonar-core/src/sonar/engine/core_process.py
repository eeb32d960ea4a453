"""An engine core in its own process: ``python -m sonar.engine.core_process`` reads an
``EngineCoreLaunch`` (JSON) from stdin, loads the model, and serves every frontend named in it
(a child forked from the frontend runs ``run_engine_core`` on the launch directly).

Three threads: the input thread receives and decodes requests (and compiles their grammars),
the main thread only steps, the output thread encodes and sends each step's outputs to the
frontend that sent the request, plus a heartbeat with the engine's load every 0.25 s.

LoRA calls (add, remove, list adapters) are applied by the main thread between steps and
answered to the frontend that made them; a removal of an adapter still in use is answered
once its last request has finished.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from sonar.config import EngineConfig
from sonar.engine import wire
from sonar.engine.process_util import freeze_startup_heap
from sonar.engine.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from sonar.lora.errors import LoRAError, LoRAInUseError

logger = logging.getLogger("sonar.engine_core")

HEARTBEAT_S = 0.25


def engine_identity(engine_index: int) -> bytes:
    return engine_index.to_bytes(2, "little")


class EngineCoreProc:
    def __init__(self, launch: wire.EngineCoreLaunch) -> None:
        from sonar.engine.engine_core import EngineCore
        from sonar.platform import current_platform

        self.config: EngineConfig = launch.config
        self.engine_index = launch.engine_index
        self.clients = launch.clients
        self.core = EngineCore.from_config(self.config, current_platform())
        self.stats = self.core.get_stats()
        self.step_started: float | None = None  # set while the main thread steps
        self.commands: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.sends: queue.Queue[tuple[int, EngineCoreOutputs | list[bytes]] | None] = queue.Queue()
        self.client_of: dict[str, int] = {}  # request id -> the frontend its outputs go to
        self.pending_removals: dict[int, list[tuple[int, int]]] = {}  # adapter id -> (frontend, call id) awaiting it
        self.context = zmq.Context()
        self._tokenizer: Any = None

    # -- threads -------------------------------------------------------------------------

    def run(self) -> None:
        inputs = []
        for addresses in self.clients:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, engine_identity(self.engine_index))
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(addresses.input)
            inputs.append(socket)
        outputs = []
        for addresses in self.clients:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(addresses.output)
            outputs.append(socket)
        freeze_startup_heap()  # the model is loaded and warmed up: what is alive now stays
        ready = wire.EngineReady(self.engine_index, os.getpid(), self.core.cache_config.num_blocks, self.config.block_size)
        for socket in inputs:
            socket.send_multipart(wire.encode_ready(ready))
        for socket in outputs:
            socket.send_multipart(wire.encode_ready(ready))
        threading.Thread(target=self._receive, args=(inputs,), name="sonar-core-input", daemon=True).start()
        sender = threading.Thread(target=self._send, args=(outputs,), name="sonar-core-output", daemon=True)
        sender.start()
        try:
            self._step_loop()
        except BaseException as exc:
            logger.error("engine core %d failed:\n%s", self.engine_index, "".join(traceback.format_exception(exc)))
            failed = wire.encode_failed(wire.EngineFailed(self.engine_index, f"{type(exc).__name__}: {exc}"))
            self.sends.put(None)
            sender.join(2.0)
            for socket in outputs:
                socket.send_multipart(failed)
            raise
        finally:
            self.sends.put(None)
            sender.join(2.0)
            self.context.destroy(linger=1000)

    def _receive(self, sockets: list[zmq.Socket]) -> None:
        """Input thread: decode what arrives; what does not decode is logged and dropped."""
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        try:
            client_of_socket = {socket: index for index, socket in enumerate(sockets)}
            while True:
                for socket, _ in poller.poll():
                    self._accept(socket.recv_multipart(copy=False), client_of_socket[socket])
        except zmq.ZMQError:  # the context is gone: the process is exiting
            return

    def _accept(self, frames: list[Any], client_index: int = 0) -> None:
        kind = frames[0].bytes if frames else b""
        try:
            if kind == wire.ADD:
                try:
                    request = wire.decode_request([f.buffer for f in frames])
                except wire.BadFrame as exc:  # tell its sender, where the id can be read, so nothing waits for it
                    request_id = wire.request_id_of([f.buffer for f in frames])
                    if request_id is not None:
                        self._reject_id(request_id, client_index, str(exc))
                    raise
                try:
                    self._prepare(request)
                except ValueError as exc:
                    self._reject(request, str(exc))
                    return
                self.commands.put((kind, request))
            elif kind == wire.ABORT:
                self.commands.put((kind, wire.decode_abort([f.bytes for f in frames]).request_ids))
            elif kind == wire.LORA:
                self.commands.put((kind, (client_index, wire.decode_lora_call([f.bytes for f in frames]))))
            elif kind == wire.SHUTDOWN and len(frames) == 1:
                self.commands.put((kind, None))
            else:
                raise wire.BadFrame(f"unknown message type {kind[:8]!r} ({len(frames)} frames)")
        except Exception as exc:  # whatever arrives, the input thread lives on
            logger.warning("engine core %d dropped a message: %s", self.engine_index, exc)

    def _prepare(self, request: EngineCoreRequest) -> None:
        """Checks a frontend already made, made again on what actually arrived, and the
        grammar compiled here, off the step loop."""
        ids = request.prompt_token_ids
        vocab = self.config.vocab_size
        if not ids or len(ids) >= self.config.max_model_len or any(t < 0 or t >= vocab for t in ids):  # type: ignore[union-attr]
            raise ValueError(f"request {request.request_id!r}: prompt token ids out of range")
        if request.max_tokens < 1 or len(ids) + request.max_tokens > self.config.max_model_len:  # type: ignore[arg-type]
            raise ValueError(f"request {request.request_id!r}: max_tokens={request.max_tokens} does not fit the context")
        if not 0 <= request.client_index < len(self.clients):
            raise ValueError(f"request {request.request_id!r}: no frontend {request.client_index}")
        if request.sampling_params.n != 1:
            raise ValueError(f"request {request.request_id!r}: n > 1 is fanned out before the engine core")
        if request.sampling_params.guided_decoding is not None:
            self._grammar_compiler().compile(request.sampling_params.guided_decoding)

    def _reject(self, request: EngineCoreRequest, reason: str, kind: str = wire.REJECTED) -> None:
        """A request that decoded but cannot run ends at once, so its frontend never waits
        (and raises: ``wire.rejection`` reads the reason back)."""
        self._reject_id(request.request_id, request.client_index, reason, kind)

    def _reject_id(self, request_id: str, client_index: int, reason: str, kind: str = wire.REJECTED) -> None:
        logger.warning("engine core %d rejected a request: %s", self.engine_index, reason)
        if 0 <= client_index < len(self.clients):
            output = EngineCoreOutput(request_id, [], finish_reason="abort", stop_reason=f"{kind}{reason}")
            self.sends.put((client_index, self._outputs_message([output])))

    def _grammar_compiler(self) -> Any:
        from sonar.engine.resolve import load_tokenizer
        from sonar.structured_output.compiler import get_grammar_compiler

        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config)
        config = self.config
        # its frontends tried every constraint in isolation before sending it: compiled directly
        return get_grammar_compiler(config.model, self._tokenizer, config.vocab_size, list(config.eos_token_ids), isolate=False)

    def _send(self, sockets: list[zmq.Socket]) -> None:
        """Output thread: send each step's outputs; a heartbeat to every frontend when idle."""
        last_sent = [0.0] * len(sockets)
        while True:
            try:
                item = self.sends.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            now = time.monotonic()
            if item:
                client_index, outputs = item
                frames = outputs if isinstance(outputs, list) else wire.encode_outputs(outputs)
                sockets[client_index].send_multipart(frames, copy=False)
                last_sent[client_index] = now
            for index, socket in enumerate(sockets):
                if now - last_sent[index] >= HEARTBEAT_S:
                    socket.send_multipart(wire.encode_outputs(self._outputs_message([])), copy=False)
                    last_sent[index] = now

    def _outputs_message(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        started = self.step_started
        elapsed = time.monotonic() - started if started is not None else 0.0
        return EngineCoreOutputs(self.engine_index, outputs, self.stats, elapsed)

    # -- the step loop (main thread) -------------------------------------------------------

    def _step_loop(self) -> None:
        core = self.core
        while True:
            block = not core.has_unfinished_requests()
            while True:
                try:
                    kind, payload = self.commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == wire.SHUTDOWN:
                    return
                self._apply(kind, payload)
            self._answer_removals()
            if not core.has_unfinished_requests():
                self.stats = core.get_stats()  # aborts freed blocks: the heartbeat says so
                continue
            self.step_started = time.monotonic()
            outputs = core.step()
            self.step_started = None
            self.stats = core.get_stats()
            self._route(outputs)
            self._answer_removals()

    def _apply(self, kind: bytes, payload: Any) -> None:
        if kind == wire.ADD:
            request: EngineCoreRequest = payload
            if request.request_id in self.client_of:
                logger.warning("engine core %d: request id %r is already running; dropped", self.engine_index, request.request_id)
                return
            try:
                self.core.add_request(request)
            except LoRAError as exc:  # its adapter cannot be served
                self._reject(request, str(exc), wire.REJECTED_ADAPTER_IN_USE if isinstance(exc, LoRAInUseError) else wire.REJECTED)
                return
            self.client_of[request.request_id] = request.client_index
        elif kind == wire.LORA:
            self._lora_call(*payload)
        elif kind == wire.ABORT:
            known = [r for r in payload if r in self.client_of]
            self.core.abort_requests(known)
            for request_id in known:
                del self.client_of[request_id]

    def _lora_call(self, client_index: int, call: wire.LoRACall) -> None:
        core = self.core
        reply = wire.LoRAReply(self.engine_index, call.call_id)
        try:
            if call.method == "add":
                reply.changed = core.add_lora(call.lora_request)
            elif call.method == "remove":
                reply.changed = core.remove_lora(call.lora_int_id)
                if reply.changed and call.lora_int_id in core.loras.removing:  # answered once its requests finish
                    self.pending_removals.setdefault(call.lora_int_id, []).append((client_index, call.call_id))
                    return
            else:
                reply.loras = core.list_loras()
        except LoRAError as exc:
            reply.error_type, reply.error = type(exc).__name__, str(exc)
        except Exception as exc:  # a broken adapter must not take the engine down
            logger.exception("engine core %d: LoRA %s failed", self.engine_index, call.method)
            reply.error_type, reply.error = "LoRAError", f"{type(exc).__name__}: {exc}"
        self.stats = core.get_stats()  # the new adapter set's version, in the next heartbeat
        self.sends.put((client_index, wire.encode_lora_reply(reply)))

    def _answer_removals(self) -> None:
        """Answer the removals of adapters whose last request has finished."""
        for lora_int_id in self.core.loras.pop_removed():
            for client_index, call_id in self.pending_removals.pop(lora_int_id, []):
                self.sends.put((client_index, wire.encode_lora_reply(wire.LoRAReply(self.engine_index, call_id, changed=True))))

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs:
            client_index = self.client_of.get(output.req_id)
            if client_index is None:
                continue
            by_client.setdefault(client_index, []).append(output)
            if output.finish_reason is not None:
                del self.client_of[output.req_id]
        for client_index, client_outputs in by_client.items():
            self.sends.put((client_index, self._outputs_message(client_outputs)))


def main() -> int:
    return run_engine_core(wire.decode_launch(sys.stdin.buffer.read()))


def run_engine_core(launch: wire.EngineCoreLaunch) -> int:
    """The engine core's process from its launch on (a fresh interpreter's ``main``, or a
    child forked from the frontend); returns its exit code."""
    from sonar.engine.process_util import exit_with_parent, set_process_title

    exit_with_parent()
    set_process_title(f"engine-core-{launch.engine_index}")
    # force: a forked child replaces the handlers of the frontend it was forked from
    logging.basicConfig(
        level=launch.log_level, format=f"%(asctime)s %(levelname)s engine-core-{launch.engine_index} %(name)s: %(message)s", force=True
    )
    try:
        EngineCoreProc(launch).run()
    except Exception:
        logger.exception("engine core %d exited on an error", launch.engine_index)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
