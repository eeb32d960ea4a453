"""The frontend's way to an engine core: in this process (the offline ``LLM``), or in
engine-core processes over ZeroMQ (``sonar serve``, and ``LLM(data_parallel_size=N)``).

An ``MPCoreClient`` binds two sockets: a ROUTER that sends requests to each engine core (by
its identity, the engine index) and a PULL that receives every engine's outputs. Its receiver
thread decodes outputs, tracks each engine's load from them, and watches each engine process
through a pidfd, so an engine that dies is noticed at once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from sonar.config import EngineConfig
from sonar.engine import wire
from sonar.engine.core_process import engine_identity
from sonar.spec_decode.stats import sum_per_position
from sonar.engine.wire import ClientAddresses, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LoRACall, LoRAReply, SchedulerStats
from sonar.lora.errors import LoRAError, LoRAInUseError
from sonar.lora.request import LoRARequest

if TYPE_CHECKING:
    from sonar.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SILENCE_DEAD_S = 5.0  # no message for this long counts as dead where no pidfd watches the process


class EngineStartError(RuntimeError):
    """An engine-core process exited or stayed silent before it was ready."""


# -- in process ---------------------------------------------------------------------------


class InprocCoreClient:
    """The engine core in this process, stepped by the caller: no threads, no copies."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def add(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step() if self.core.has_unfinished_requests() else []

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Marks it removed; dropped once its requests finish (the caller steps them)."""
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.core.list_loras()

    def lora_removal_pending(self, lora_int_id: int) -> bool:
        return lora_int_id in self.core.loras.removing

    def close(self) -> None:
        self.core.executor.shutdown()


# -- engine-core processes ------------------------------------------------------------------


IPC_DIR_ENV = "SONAR_IPC_DIR"


def new_ipc_dir() -> str:
    """A private directory (mode 0700) for one server's sockets: only its user can connect.
    Made under ``SONAR_IPC_DIR`` where that is set (a tmpfs, say), else the temp directory."""
    parent = os.environ.get(IPC_DIR_ENV) or None
    if parent:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix="sonar-ipc-", dir=parent)


def client_addresses(ipc_dir: str, client_index: int) -> ClientAddresses:
    return ClientAddresses(f"ipc://{ipc_dir}/input-{client_index}", f"ipc://{ipc_dir}/output-{client_index}")


class EngineProcesses:
    """The engine-core processes of one engine configuration, one per data-parallel replica.

    :param config: the resolved configuration every replica runs.
    :param clients: the sockets of every frontend that talks to them.
    :param replica_env: environment for replica ``i`` of ``n`` with ``r`` worker ranks each
        (``Platform.replica_env``: the platform's device choice).
    :param fork: start each replica by forking this process where that is sound now (the
        platform allows it, ``Platform.fork_children``, and this process runs one thread): it
        then skips importing torch and Sonar again. Otherwise, and by default, a fresh
        interpreter (``python -m sonar.engine.core_process``).
    :param close_fds: descriptors a forked replica closes (the frontend's listening socket).
    """

    def __init__(
        self,
        config: EngineConfig,
        clients: list[ClientAddresses],
        replica_env: Callable[[int, int, int], dict[str, str]],
        log_level: str = "WARNING",
        fork: bool = False,
        close_fds: Sequence[int] = (),
    ) -> None:
        from sonar.engine.process_util import ForkedProcess, single_threaded

        self.processes: list[subprocess.Popen | ForkedProcess] = []
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size  # each replica's group
        fork = fork and single_threaded()
        for index in range(config.data_parallel_size):
            launch = wire.EngineCoreLaunch(config, index, clients, log_level)
            # the platform the configuration was resolved for, not a second detection's choice
            env = {"SONAR_PLATFORM": config.platform, **replica_env(index, config.data_parallel_size, ranks)}
            if fork:
                from sonar.engine.core_process import run_engine_core

                self.processes.append(ForkedProcess(functools.partial(run_engine_core, launch), env, close_fds))
                continue
            # its own session: a Ctrl-C in the terminal reaches the frontend, which drains first
            process = subprocess.Popen(
                [sys.executable, "-m", "sonar.engine.core_process"], stdin=subprocess.PIPE, env={**os.environ, **env}, start_new_session=True
            )
            assert process.stdin is not None
            process.stdin.write(wire.encode_launch(launch))
            process.stdin.close()
            self.processes.append(process)
        logger.debug("engine cores %s: %s", "forked" if fork else "started", [process.pid for process in self.processes])

    def check_started(self) -> None:
        """Raise if a replica has exited (while the frontend waits for it to be ready)."""
        for index, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                raise EngineStartError(f"engine core {index} exited with code {code} while starting (its log above says why)")

    def reap(self) -> None:
        """Collect replicas that exited (no zombies while the server runs on)."""
        for process in self.processes:
            process.poll()

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every replica: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@dataclass(slots=True)
class EngineState:
    """What a frontend knows about one engine core."""

    index: int
    pid: int = 0
    alive: bool = True
    error: str | None = None
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    step_elapsed_s: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    num_sent_since_stats: int = 0  # requests sent after its latest stats were reported

    @property
    def load(self) -> tuple[int, float]:
        stats = self.stats
        return stats.num_waiting * 4 + stats.num_running + self.num_sent_since_stats, stats.kv_cache_usage


class MPCoreClient:
    """One frontend's end of the sockets to ``num_engines`` engine-core processes.

    :param addresses: the sockets this frontend binds.
    :param client_index: its index among the frontends (engine cores route outputs by it).
    :param num_engines: how many engine cores will connect.
    :param on_outputs: called on the receiver thread with each message of outputs.
    :param on_engine_dead: called on the receiver thread with (engine index, reason), once.
    :param check_started: called while waiting for the engines; raises if one has exited.
    """

    def __init__(
        self,
        addresses: ClientAddresses,
        client_index: int,
        num_engines: int,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_engine_dead: Callable[[int, str], None],
        check_started: Callable[[], None] | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.client_index = client_index
        self.engines = [EngineState(i) for i in range(num_engines)]
        self.on_outputs = on_outputs
        self.on_engine_dead = on_engine_dead
        self.context = zmq.Context()
        self.requests = self.context.socket(zmq.ROUTER)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone engine raises
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self.requests.bind(addresses.input)
        self.outputs = self.context.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(addresses.output)
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._lora_calls: dict[tuple[int, int], concurrent.futures.Future[LoRAReply]] = {}  # (engine, call id) -> its reply
        self._closed = False
        self._pidfds: dict[int, int] = {}
        self._wait_ready(check_started, startup_timeout)
        self._thread = threading.Thread(target=self._receive, name=f"sonar-client-{client_index}-outputs", daemon=True)
        self._thread.start()

    # -- sending (any thread) ----------------------------------------------------------------

    def choose_engine(self, avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """The live engine with the least load (waiting, running, just sent; then KV use),
        leaving out those in ``avoid`` (stuck ones) unless nothing else is alive."""
        live = [e for e in self.engines if e.alive]
        if not live:
            raise RuntimeError("no engine core is alive")
        preferred = [e for e in live if e.index not in avoid] or live
        return min(preferred, key=lambda e: e.load).index

    def add(self, engine_index: int, requests: list[EngineCoreRequest]) -> None:
        engine = self.engines[engine_index]
        identity = engine_identity(engine_index)
        with self._send_lock:
            for request in requests:
                self.requests.send_multipart([identity, *wire.encode_request(request)], copy=False)
            engine.num_sent_since_stats += len(requests)

    def abort(self, engine_index: int, request_ids: list[str]) -> None:
        if not request_ids or not self.engines[engine_index].alive:
            return
        try:
            with self._send_lock:
                self.requests.send_multipart([engine_identity(engine_index), *wire.encode_abort(request_ids)])
        except zmq.ZMQError as exc:  # the engine is gone: its requests are gone with it
            logger.debug("abort not sent to engine core %d: %s", engine_index, exc)

    def call_lora(self, engine_index: int, method: str, lora_request: LoRARequest | None = None, lora_int_id: int = 0) -> concurrent.futures.Future[LoRAReply]:
        """Send a LoRA call to one engine core; the future gets its reply (or fails with
        ``RuntimeError`` if the engine dies first)."""
        call = LoRACall(next(self._call_ids), method, lora_request, lora_int_id)
        future: concurrent.futures.Future[LoRAReply] = concurrent.futures.Future()
        engine = self.engines[engine_index]
        with self._send_lock:
            if not engine.alive:
                future.set_exception(RuntimeError(f"engine core {engine_index} is dead: {engine.error}"))
                return future
            self._lora_calls[(engine_index, call.call_id)] = future
            try:
                self.requests.send_multipart([engine_identity(engine_index), *wire.encode_lora_call(call)])
            except zmq.ZMQError as exc:
                del self._lora_calls[(engine_index, call.call_id)]
                future.set_exception(RuntimeError(f"engine core {engine_index} cannot be reached: {exc}"))
        return future

    def call_lora_everywhere(self, method: str, lora_request: LoRARequest | None = None, lora_int_id: int = 0) -> list[concurrent.futures.Future[LoRAReply]]:
        """The same LoRA call on every live engine core (each serves the same adapters)."""
        return [self.call_lora(e.index, method, lora_request, lora_int_id) for e in self.engines if e.alive]

    def shutdown_engines(self) -> None:
        """Ask every live engine core to exit once it has read what was sent before."""
        with self._send_lock:
            for engine in self.engines:
                if engine.alive:
                    try:
                        self.requests.send_multipart([engine_identity(engine.index), wire.SHUTDOWN])
                    except zmq.ZMQError:
                        pass

    def close(self) -> None:
        self._closed = True
        self._thread.join(1.0)
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self.context.destroy(linger=0)

    # -- state -------------------------------------------------------------------------------

    @property
    def num_alive(self) -> int:
        return sum(e.alive for e in self.engines)

    def stuck_engines(self, step_timeout: float) -> list[int]:
        """Live engines whose current step has run past ``step_timeout`` seconds."""
        now = time.monotonic()
        stuck = []
        for engine in self.engines:
            silent = now - engine.last_seen
            if engine.alive and (engine.step_elapsed_s + silent > step_timeout):
                stuck.append(engine.index)
        return stuck

    def get_stats(self) -> SchedulerStats:
        """Every live engine's latest stats, summed (KV use: the mean)."""
        live = [e.stats for e in self.engines if e.alive]
        total = SchedulerStats()
        for stats in live:
            for name in SchedulerStats.__struct_fields__:
                value = getattr(stats, name)
                if isinstance(value, list):  # counts by position: summed position by position
                    value = sum_per_position(getattr(total, name), value)
                    setattr(total, name, value)
                else:
                    setattr(total, name, getattr(total, name) + value)
        if live:
            total.kv_cache_usage /= len(live)
        return total

    # -- receiving (its own thread) ----------------------------------------------------------

    def _wait_ready(self, check_started: Callable[[], None] | None, timeout: float) -> None:
        pending = {e.index for e in self.engines}
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine core(s) {sorted(pending)} were not ready within {timeout:.0f}s")
            if check_started is not None:
                check_started()
            if not self.requests.poll(200):
                continue
            frames = self.requests.recv_multipart()
            identity, rest = frames[0], frames[1:]
            if not rest or rest[0] != wire.READY:
                continue
            try:
                ready = wire.decode_ready(rest)
            except wire.BadFrame as exc:
                logger.warning("dropped a bad ready message: %s", exc)
                continue
            if ready.engine_index not in pending or identity != engine_identity(ready.engine_index):
                continue
            pending.discard(ready.engine_index)
            engine = self.engines[ready.engine_index]
            engine.pid, engine.last_seen = ready.pid, time.monotonic()
            try:
                self._pidfds[ready.engine_index] = os.pidfd_open(ready.pid)
            except (AttributeError, OSError):  # no pidfds here: silence will tell
                pass

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.outputs, zmq.POLLIN)
        engine_of_fd = {fd: index for index, fd in self._pidfds.items()}
        for fd in engine_of_fd:
            poller.register(fd, zmq.POLLIN)
        while not self._closed:
            try:
                events = poller.poll(100)
            except zmq.ZMQError:
                return
            for item, _ in events:
                if item is self.outputs:
                    self._read_outputs()
                else:
                    poller.unregister(item)
                    self._engine_died(engine_of_fd[item], "the engine core process exited")
            if not self._pidfds:
                self._check_silence()

    def _read_outputs(self) -> None:
        while True:
            try:
                frames = self.outputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = frames[0] if frames else b""
            try:
                if kind == wire.OUTPUTS:
                    outputs = wire.decode_outputs(frames)
                elif kind == wire.FAILED:
                    failed = wire.decode_failed(frames)
                    self._valid_engine(failed.engine_index)
                    self._engine_died(failed.engine_index, failed.error)
                    continue
                elif kind == wire.READY:
                    continue
                elif kind == wire.LORA_REPLY:
                    self._lora_replied(wire.decode_lora_reply(frames))
                    continue
                else:
                    raise wire.BadFrame(f"unknown message type {kind[:8]!r}")
                engine = self.engines[self._valid_engine(outputs.engine_index)]
            except Exception as exc:  # whatever arrives, the receiver thread lives on
                logger.warning("dropped a bad message from an engine core socket: %s", exc)
                continue
            engine.stats, engine.step_elapsed_s = outputs.stats, outputs.step_elapsed_s
            engine.last_seen, engine.num_sent_since_stats = time.monotonic(), 0
            if outputs.outputs and engine.alive:
                try:
                    self.on_outputs(outputs)
                except Exception:
                    logger.exception("processing engine outputs failed")

    def _lora_replied(self, reply: LoRAReply) -> None:
        with self._send_lock:
            future = self._lora_calls.pop((reply.engine_index, reply.call_id), None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _valid_engine(self, index: int) -> int:
        if not 0 <= index < len(self.engines):
            raise wire.BadFrame(f"no engine core {index}")
        return index

    def _check_silence(self) -> None:
        now = time.monotonic()
        for engine in self.engines:
            if engine.alive and now - engine.last_seen > SILENCE_DEAD_S:
                self._engine_died(engine.index, f"no word from the engine core for {SILENCE_DEAD_S:.0f}s")

    def _engine_died(self, index: int, reason: str) -> None:
        engine = self.engines[index]
        if not engine.alive:
            return
        engine.alive, engine.error = False, reason
        logger.error("engine core %d is dead: %s", index, reason)
        fd = self._pidfds.pop(index, None)
        if fd is not None:
            os.close(fd)
        with self._send_lock:
            calls = [key for key in self._lora_calls if key[0] == index]
            futures = [self._lora_calls.pop(key) for key in calls]
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError(f"engine core {index} died before answering: {reason}"))
        self.on_engine_dead(index, reason)



def lora_reply_result(replies: list[LoRAReply]) -> bool:
    """Whether any engine core changed its adapters; raises the first error an engine core
    answered (``LoRAInUseError`` or ``LoRAError``, with the engine's message)."""
    for reply in replies:
        if reply.error is not None:
            error_cls = LoRAInUseError if reply.error_type == "LoRAInUseError" else LoRAError
            raise error_cls(reply.error)
    return any(reply.changed for reply in replies)
