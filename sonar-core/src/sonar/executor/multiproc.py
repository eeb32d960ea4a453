"""Runs one worker process per rank of a tensor-parallel group on this host.

Each rank is a spawned process that joins ``torch.distributed`` with the platform's backend
(``Platform.dist_backend``), builds its shard of the model and then executes what the
executor sends it: every step's ``SchedulerOutput`` is encoded once as msgpack (plain data,
never pickled) and written once into a shared-memory ring every rank reads
(``sonar.executor.shm_broadcast``); a message larger than a ring slot goes over each rank's
Unix socket instead. Replies (only rank 0 answers a step) come back over the sockets. A rank
that dies or stops answering fails the engine with ``WorkerDiedError`` instead of leaving it
waiting.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from sonar.config import EngineConfig, ModelConfig
from sonar.engine.kv_cache_spec import KVCacheSpec
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.engine.process_util import forks_children
from sonar.executor.base import Executor, WorkerDiedError
from sonar.executor.shm_broadcast import RingReader, RingTimeout, RingWriter
from sonar.platform import Platform

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_ENV = "SONAR_WORKER_STARTUP_TIMEOUT_S"
STEP_TIMEOUT_ENV = "SONAR_WORKER_STEP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint
DEFAULT_STEP_TIMEOUT_S = 300.0  # a step (or a profile) that runs longer is a hung rank
RING_SLOT_BYTES_ENV = "SONAR_TP_RING_SLOT_BYTES"
DEFAULT_RING_SLOT_BYTES = 4 << 20  # a step message larger than this goes over the sockets
IDLE_CHECK_S = 5.0  # an idle rank checks this often that the executor is still there
OVERFLOW = b"\x00"  # in the ring: the message was too large for a slot and comes on the socket
STOP = b"\x01"  # in the ring: the executor is shutting down; the ranks leave their loop at once
STOP_WAIT_S = 2.0  # how long a shutdown waits for the ranks to exit before killing them
# what the executor may ask every rank to run (anything else is refused by the worker)
WORKER_CALLS = frozenset({
    "kv_cache_windows", "kv_bytes_per_block", "available_kv_cache_bytes", "init_kv_cache", "profile_report", "step",
    "add_lora", "remove_lora",
})


class WorkerCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What the executor asks every rank: a worker method and its arguments (plain values)."""

    method: str
    args: list[Any] = []
    step: SchedulerOutput | None = None  # for "step"
    grammar_bitmask: bytes | None = None  # the step's bitmask as int32 bytes (its shape below)
    grammar_bitmask_shape: list[int] = []


class WorkerReply(msgspec.Struct, array_like=True):
    """A rank's answer: a value, the output of a step (rank 0), the error it raised, or
    why it refused a call and goes on (an adapter it cannot serve)."""

    value: Any = None
    output: ModelRunnerOutput | None = None
    error: str | None = None
    refused: str | None = None


RingInfo = tuple[str, int, int, int, int]  # ring name, num_readers, num_slots, slot_bytes, the rank's local rank


def encode_ring_info(ring: RingWriter, local_rank: int) -> bytes:
    """What a rank needs to read ``ring``: it is reader ``local_rank``, its rank on this host
    (which also picks its device)."""
    return msgspec.msgpack.encode([ring.name, ring.num_readers, ring.num_slots, ring.slot_bytes, local_rank])


def _timeout(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{env}={value} must be positive")
    return value


def _ring_slot_bytes() -> int:
    raw = os.environ.get(RING_SLOT_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_RING_SLOT_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{RING_SLOT_BYTES_ENV}={raw!r} must be a positive number of bytes")
    return int(raw)


#: Where the ranks' rendezvous port is looked for, below the kernel's ephemeral range.
RENDEZVOUS_PORT_FLOOR = 10000
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _rendezvous_port() -> int:
    """A free port on 127.0.0.1 for the ranks' rendezvous, below the kernel's ephemeral range
    where the host says what it is: rank 0 binds the port seconds after it is chosen, and a
    port of that range may meanwhile become the local end of any outgoing connection (the
    ranks' own links back to this process are made then), which fails rank 0's bind."""
    low = _ephemeral_low()
    if low is not None and low > RENDEZVOUS_PORT_FLOOR:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(RENDEZVOUS_PORT_FLOOR, low)
            if _port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (None where it cannot be read)."""
    try:
        with open(PORT_RANGE_FILE) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class MultiprocExecutor(Executor):
    """One spawned worker process per tensor-parallel rank; rank 0's results are the step's.

    Selected for ``tensor_parallel_size > 1`` (registered as ``"mp"``). Construction starts the
    ranks and returns once every one has loaded its shard of the model (or raises the first
    error one reported).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, platform: type[Platform]) -> None:
        super().__init__(config, model_config, platform)
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size  # stage-major ranks
        self.output_rank = output_rank_of(config)  # the rank whose step results are the engine's
        self.num_in_flight = 0  # steps launched and not fetched yet
        self._early_outputs: collections.deque[ModelRunnerOutput] = collections.deque()  # fetched before their turn
        self.peak_in_flight = 0  # the most steps ever in flight at once (pipeline parallelism: up to pp)
        self.step_timeout_s = _timeout(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._dead: WorkerDiedError | None = None
        init_method = f"tcp://127.0.0.1:{_rendezvous_port()}"
        config_json = msgspec.json.encode(config)
        self.processes: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.sockets: list[socket.socket] = []
        followers = []  # other hosts' ranks (sonar.executor.multinode): each reads the ring through a link process
        if config.nnodes > 1:
            from sonar.executor.multinode import accept_followers, rendezvous_address

            followers, init_method = accept_followers(config, self.world_size), rendezvous_address(config)
        num_local = self.world_size // config.nnodes
        fork = forks_children(platform)
        self.ring = RingWriter(num_local + len(followers), slot_bytes=_ring_slot_bytes())
        try:
            for rank in range(num_local):
                ours, theirs = socket.socketpair()
                env = {**os.environ, **platform.rank_env(rank, num_local)}
                args = [str(rank), str(self.world_size), init_method, logging.getLevelName(logging.getLogger().getEffectiveLevel())]
                process = _start_rank(args, theirs, env, fork)
                theirs.close()
                self.sockets.append(ours)  # kept to tell a closed peer from a pending reply
                conn = Connection(os.dup(ours.fileno()))
                conn.send_bytes(config_json)
                conn.send_bytes(encode_ring_info(self.ring, local_rank=rank))
                self.processes.append(process)
                self.conns.append(conn)
            for index, follower in enumerate(followers):  # its ranks' replies come from its link process
                link, rank_sockets = follower.start_link_process(self.ring, reader_index=num_local + index)
                self.processes += [link] * len(rank_sockets)
                self.sockets += rank_sockets
                self.conns += [Connection(os.dup(sock.fileno())) for sock in rank_sockets]
            self._gather(_timeout(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S), "load the model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        """The process id of each rank, in rank order."""
        return [process.pid for process in self.processes]

    # -- talking to the ranks ------------------------------------------------------------

    def _send(self, call: WorkerCall) -> None:
        if self._dead is not None:
            raise self._dead
        data = self._encoder.encode(call)
        alive = lambda: all(process.poll() is None for process in self.processes)  # noqa: E731
        try:
            if self.ring.write(data, self.step_timeout_s, alive):
                return
            self.ring.write(OVERFLOW, self.step_timeout_s, alive)  # larger than a slot: on the sockets
        except RingTimeout as exc:
            self._fail(f"a worker rank stopped reading the executor's messages ({exc})")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._fail(f"worker rank {rank} is gone (its socket closed)")

    def _receive(self, rank: int, timeout_s: float, what: str) -> WorkerReply:
        """Rank ``rank``'s reply, watching every rank: one whose socket closes (it exited)
        fails the engine, and so does a silence longer than ``timeout_s``."""
        if self._dead is not None:
            raise self._dead
        deadline = time.monotonic() + timeout_s
        watched = list(self.conns)
        while self.conns[rank] not in (ready := wait(watched, max(0.0, deadline - time.monotonic()))):
            if not ready:
                self._fail(f"worker rank {rank} did not answer within {timeout_s:.0f} s when asked to {what}")
            for conn in ready:  # another rank: closed (it exited), or a reply read later
                other = self.conns.index(conn)
                if self._closed(other):
                    self._fail(self._death(other, what))
                watched.remove(conn)
        try:
            reply = self._reply_decoder.decode(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            self._fail(self._death(rank, what))
        if reply.error is not None:
            raise RuntimeError(f"worker rank {rank} failed to {what}: {reply.error}")
        return reply

    def _closed(self, rank: int) -> bool:
        """Whether rank ``rank``'s end of its socket is closed (the process exited)."""
        try:
            return self.sockets[rank].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _death(self, rank: int, what: str) -> str:
        try:
            code = self.processes[rank].wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"worker rank {rank} died (exit code {code}) while asked to {what}"

    def _fail(self, message: str) -> None:
        self._dead = WorkerDiedError(message)
        logger.error("%s; stopping the other ranks", message)
        self.shutdown()
        raise self._dead

    def _gather(self, timeout_s: float, what: str) -> list[Any]:
        """Every rank's reply value, in rank order, read as they come: the first error (or
        exit) fails at once, without waiting on ranks it leaves stuck."""
        if self._dead is not None:
            raise self._dead
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        refusals: dict[int, str] = {}
        while len(values) < self.world_size:
            pending = [conn for rank, conn in enumerate(self.conns) if rank not in values]
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                silent = [rank for rank in range(self.world_size) if rank not in values]
                self._fail(f"worker ranks {silent} did not answer within {timeout_s:.0f} s when asked to {what}")
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    reply = self._reply_decoder.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death(rank, what))
                if reply.error is not None:
                    self.shutdown()
                    raise RuntimeError(f"worker rank {rank} failed to {what}: {reply.error}")
                if reply.refused is not None:
                    refusals[rank] = reply.refused
                values[rank] = reply.value
        if refusals:
            from sonar.lora.errors import LoRAError

            raise LoRAError(refusals[min(refusals)])
        return [values[rank] for rank in range(self.world_size)]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        self._send(WorkerCall(method, list(args)))
        return self._gather(self.step_timeout_s, method)

    def _call_all_between_steps(self, method: str, *args: Any) -> list[Any]:
        """``_call_all`` while steps may be in flight: the ranks run calls in the order sent,
        so the output rank answers the launched steps first; those outputs are kept for
        ``fetch``."""
        self._send(WorkerCall(method, list(args)))
        while len(self._early_outputs) < self.num_in_flight:
            self._early_outputs.append(self._receive(self.output_rank, self.step_timeout_s, "run a step").output)
        return self._gather(self.step_timeout_s, method)

    # -- the executor interface ----------------------------------------------------------

    def kv_cache_specs(self) -> list[KVCacheSpec] | None:
        from sonar.model_interface import kv_cache_spec_for

        tp = self.config.tensor_parallel_size
        stage_windows = self._call_all("kv_cache_windows")[::tp]  # each stage's layers, in order
        if any(windows is None for windows in stage_windows):
            return None
        return [kv_cache_spec_for(window) for windows in stage_windows for window in windows]

    def kv_bytes_per_block(self) -> int:
        return self._call_all("kv_bytes_per_block")[0]

    def available_kv_cache_bytes(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        return min(self._call_all("available_kv_cache_bytes", self.config.gpu_memory_utilization))

    def available_kv_blocks(self) -> int:
        """The fewest blocks any rank's budget holds (pipeline stages differ in layers, so in
        bytes per block)."""
        if self.config.pipeline_parallel_size == 1:
            return super().available_kv_blocks()
        per_block = self._call_all("kv_bytes_per_block")
        if self.config.kv_cache_memory_bytes is not None:
            budgets = [self.config.kv_cache_memory_bytes] * self.world_size
        else:
            budgets = self._call_all("available_kv_cache_bytes", self.config.gpu_memory_utilization)
        return min(budget // size for budget, size in zip(budgets, per_block))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", num_blocks)

    def profile_report(self) -> dict[str, int]:
        return self._call_all("profile_report")[0]

    def add_lora(self, lora_request: Any) -> None:
        """Every rank reads and checks the adapter (the request goes to them as plain data) and
        keeps its piece of each module's A and B.

        :raises LoRAError: a rank refused it (then every rank forgets it again).
        """
        from sonar.lora.errors import LoRAError

        try:
            self._call_all_between_steps("add_lora", lora_request)
        except LoRAError:
            self._call_all_between_steps("remove_lora", lora_request.lora_int_id)
            raise

    def remove_lora(self, lora_int_id: int) -> None:
        self._call_all_between_steps("remove_lora", lora_int_id)

    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        bitmask = scheduler_output.grammar_bitmask
        call = WorkerCall("step", step=scheduler_output)
        if bitmask is not None:  # a host int32 tensor: sent as its bytes
            call.grammar_bitmask = bitmask.contiguous().numpy().tobytes()
            call.grammar_bitmask_shape = list(bitmask.shape)
            scheduler_output.grammar_bitmask = None
            try:
                self._send(call)
            finally:
                scheduler_output.grammar_bitmask = bitmask
        else:
            self._send(call)
        self.num_in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
        return None

    def fetch(self, handle: Any) -> ModelRunnerOutput:
        """The oldest launched step's output (steps answer in the order they were launched)."""
        if self._early_outputs:  # read while a LoRA call waited for its answers
            output = self._early_outputs.popleft()
        else:
            output = self._receive(self.output_rank, self.step_timeout_s, "run a step").output
        self.num_in_flight -= 1
        return output

    def shutdown(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []
        stop_ranks(self.conns, self.processes, self.ring)
        self.conns = []
        self.ring.unlink()
        if self._dead is None:
            self._dead = WorkerDiedError("the executor was shut down")


def _start_rank(args: list[str], sock: socket.socket, env: dict[str, str], fork: bool) -> subprocess.Popen | Any:
    """A rank's process: forked by this process's fork server where the platform allows it
    (no second import of torch and the model code), else a fresh interpreter."""
    if fork:
        from sonar.engine.fork_server import ForkServer, ForkServerError

        try:
            return ForkServer.shared().start("tp-rank", args, [sock.fileno()], env)
        except ForkServerError as exc:
            logger.info("starting rank %s as a fresh interpreter: %s", args[0], exc)
    rank, world_size, init_method, level = args
    return subprocess.Popen(
        [sys.executable, "-m", "sonar.executor.multiproc", rank, world_size, init_method, str(sock.fileno()), level],
        pass_fds=(sock.fileno(),), env=env,
    )


def stop_ranks(conns: list[Connection], processes: list[subprocess.Popen], ring: RingWriter | None = None) -> None:
    """Tell the ranks to stop through the ring (an idle rank reads it at once), close their
    sockets (a rank also exits when its socket closes), then kill any rank still there
    ``STOP_WAIT_S`` after."""
    alive = lambda: all(process.poll() is None for process in processes)  # noqa: E731
    if ring is not None and processes and alive():
        try:
            ring.write(STOP, timeout_s=0.5, alive=alive)  # a rank still in a step reads it after
        except RingTimeout:
            pass  # a rank stopped reading: the socket close and the kill below still end it
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=2.0)


# -- the worker process ----------------------------------------------------------------------


def run_worker(rank: int, world_size: int, init_method: str, conn: Connection) -> None:
    """A rank's process: read the engine configuration (JSON), join the group, load this
    rank's shard, then serve calls until the executor's end of the socket closes. A failure
    at load is reported and ends the process; a failure in a step ends it too (the group
    cannot go on without it)."""
    import torch

    from sonar.distributed import building_for, init_distributed
    from sonar.pipeline import building_stage
    from sonar.engine.resolve import model_config_of
    from sonar.platform import current_platform
    from sonar.registry import import_class

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerCall)
    try:
        config = msgspec.json.decode(conn.recv_bytes(), type=EngineConfig)
        ring_name, num_readers, num_slots, slot_bytes, local_rank = msgspec.msgpack.decode(conn.recv_bytes(), type=RingInfo)
        ring = RingReader(ring_name, local_rank, num_readers, num_slots, slot_bytes)
        platform = current_platform()
        group = init_distributed(platform, rank, world_size, init_method, local_rank=local_rank)
        model_config = model_config_of(config)
        group, stage = _join_stages(platform, group, rank, config, model_config)
        group = dataclasses.replace(group, expert_parallel=config.enable_expert_parallel)  # MoE: whole experts per rank
        worker = import_class(platform.worker_cls)(platform, model_config, config, rank=local_rank)  # rank: its device on this host
        with building_for(group), building_stage(stage):
            worker.load_model()
    except BaseException as exc:
        conn.send_bytes(encoder.encode(WorkerReply(error=f"{type(exc).__name__}: {exc}")))
        logger.error("worker rank %d failed to start:\n%s", rank, traceback.format_exc())
        return
    conn.send_bytes(encoder.encode(WorkerReply()))
    peer = socket.socket(fileno=os.dup(conn.fileno()))  # to tell the executor's exit from a message
    while True:
        try:
            data = ring.read(IDLE_CHECK_S)
            if data == STOP:
                break
            if data == OVERFLOW:
                data = conn.recv_bytes()
            call = decoder.decode(data)
        except RingTimeout:  # idle: go on waiting while the executor lives
            if _peer_closed(peer):
                break
            continue
        except (EOFError, OSError):  # the executor is gone
            break
        if call.method not in WORKER_CALLS:
            conn.send_bytes(encoder.encode(WorkerReply(error=f"unknown worker call {call.method!r}")))
            continue
        try:
            if call.method == "step":
                step = call.step
                if call.grammar_bitmask is not None:
                    step.grammar_bitmask = torch.frombuffer(bytearray(call.grammar_bitmask), dtype=torch.int32).view(
                        call.grammar_bitmask_shape
                    )
                output = worker.execute_model(step)
                if rank == output_rank_of(config):
                    conn.send_bytes(encoder.encode(WorkerReply(output=output)))
            elif call.method == "add_lora":
                conn.send_bytes(encoder.encode(_add_lora(worker, call.args[0])))
            elif call.method == "kv_cache_windows":
                specs = worker.kv_cache_specs()
                windows = None if specs is None else [getattr(spec, "sliding_window", None) for spec in specs]
                conn.send_bytes(encoder.encode(WorkerReply(value=windows)))
            else:
                conn.send_bytes(encoder.encode(WorkerReply(value=getattr(worker, call.method)(*call.args))))
        except BaseException:
            logger.error("worker rank %d failed in %s:\n%s", rank, call.method, traceback.format_exc())
            os._exit(1)  # the other ranks wait on this one in collectives: fail the group
    ring.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def output_rank_of(config: EngineConfig) -> int:
    """The rank that answers steps: the first of the last pipeline stage (rank 0 without one)."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def _join_stages(platform: type[Platform], group: Any, rank: int, config: EngineConfig, model_config: ModelConfig) -> tuple[Any, Any]:
    """This rank's tensor-parallel group and pipeline stage (``sonar.pipeline``): the group it
    joined as is, and the whole model, without pipeline parallelism."""
    from sonar.pipeline import WHOLE_MODEL, join_stage_groups, stage_of
    from sonar.registry import import_class

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return group, WHOLE_MODEL
    group, link = join_stage_groups(rank, tp, pp, import_class(platform.communicator_cls))
    return group, stage_of(rank // tp, pp, model_config.hf_config.num_hidden_layers, link)


def _add_lora(worker: Any, fields: Any) -> WorkerReply:
    """A rank's answer to ``add_lora`` (the request's fields as plain data): a refusal it
    survives where the adapter cannot be served."""
    from sonar.lora.errors import LoRAError
    from sonar.lora.request import LoRARequest

    try:
        worker.add_lora(LoRARequest(*fields) if isinstance(fields, (list, tuple)) else fields)
    except LoRAError as exc:
        return WorkerReply(refused=str(exc))
    return WorkerReply()


def _peer_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def rank_process_main(args: list[str], fds: list[int]) -> None:
    """A rank's process from its start (a fresh interpreter's ``__main__``, or a child of the
    fork server): ``args`` are its rank, the world size, the group's init method and the log
    level; ``fds[0]`` its socket to the executor. Does not return."""
    from sonar.engine.process_util import exit_with_parent, set_process_title

    rank, world_size, init_method, level = args
    exit_with_parent()  # a rank waiting in a collective does not read its socket
    set_process_title(f"tp-worker-{rank}")
    logging.basicConfig(level=level, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s", force=True)
    run_worker(int(rank), int(world_size), init_method, Connection(fds[0]))
    # the ring, sockets and process group are closed: skip the interpreter's teardown of torch
    # (most of a second per rank at every shutdown)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank, _world_size, _init_method, _fd, _level = sys.argv[1:6]
    rank_process_main([_rank, _world_size, _init_method, _level], [int(_fd)])
