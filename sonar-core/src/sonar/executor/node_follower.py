"""A follower host of a multi-node run (``sonar serve ... --headless``): join the head's
control link, run this host's ranks, relay between them and the head.

The follower connects to ``master_addr:master_port + 1`` (retrying while the head starts),
introduces itself and waits for the head's ``Start``; then it starts its ranks (the same
worker processes a single host runs, ``python -m sonar.executor.multiproc``) and relays:
each ``Broadcast`` from the head is written once into its own shared-memory ring (larger
than a slot: to each rank's socket), each rank's reply goes back as a ``Reply``. The head
gone (the link closed) or one of its ranks dead stops every rank of the host and ends the
follower. See ``sonar.executor.multinode`` for the head's side.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from sonar.config import EngineConfig
from sonar.executor.multinode import HELLO_TIMEOUT_S, NodeLayout, control_port, rendezvous_address
from sonar.executor.multiproc import (
    DEFAULT_STARTUP_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S, IDLE_CHECK_S, OVERFLOW, STARTUP_TIMEOUT_ENV, STEP_TIMEOUT_ENV,
    _ring_slot_bytes, _timeout, encode_ring_info, stop_ranks,
)
from sonar.executor.node_wire import (
    FOLLOWER, HEAD, MAX_GREETING_BYTES, PROTOCOL_VERSION, SECRET_ENV, Broadcast, Challenge, Hello, LinkError, RankExited,
    Reply, Shutdown, Start, Verdict, comparable_config, keep_alive, model_fingerprint, new_nonce, node_secret, prove, proves,
    receive_message, send_message,
)
from sonar.executor.shm_broadcast import RingTimeout, RingWriter
from sonar.platform import Platform

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 1.0  # a follower started before its head retries this often



def run_follower(config: EngineConfig, platform: type[Platform]) -> int:
    """A follower host (``sonar serve ... --headless``): join the head, run this host's ranks
    and relay between them and the head until either goes; returns the exit code."""
    layout = NodeLayout(config.tensor_parallel_size * config.pipeline_parallel_size, config.nnodes, config.node_rank)
    link = _join_head(config)
    stopping = threading.Event()

    def stop(sig: int, frame: Any) -> None:
        stopping.set()
        try:
            link.shutdown(socket.SHUT_RDWR)  # wakes the relay
        except OSError:
            pass

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    relay = None
    try:
        message = receive_message(link)
        if not isinstance(message, Start):
            raise LinkError(f"expected Start from the head, got a {type(message).__name__}")
        relay = RankRelay(config, layout, platform, link)
        code = relay.run()
        if code == 0:
            logger.info("the head shut down; stopping this host's ranks")
        return code
    except LinkError as exc:
        if stopping.is_set():
            return 0
        logger.error("the head at %s:%d is gone (%s); stopping this host's ranks", config.master_addr, control_port(config), exc)
        return 1
    finally:
        if relay is not None:
            relay.shutdown()
        link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _join_head(config: EngineConfig) -> socket.socket:
    """Connect to the head's control link (retrying while the head starts) and be accepted.

    :raises ValueError: the head refused this host (the reason says why).
    :raises RuntimeError: the head could not be reached within the startup timeout, or did not answer.
    """
    timeout_s = _timeout(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S)
    address = (config.master_addr, control_port(config))
    deadline = time.monotonic() + timeout_s
    logger.info("node rank %d: joining the head at %s:%d", config.node_rank, *address)
    while True:
        try:
            sock = socket.create_connection(address, timeout=HELLO_TIMEOUT_S)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"could not reach the head's control link at {address[0]}:{address[1]} within {timeout_s:.0f} s ({exc}); "
                    f"start the head (node rank 0) with --master-port {config.master_port}"
                ) from None
            time.sleep(CONNECT_RETRY_S)
    head = f"the head at {address[0]}:{address[1]}"
    secret = node_secret()
    nonce = new_nonce()
    try:
        challenge = receive_message(sock, MAX_GREETING_BYTES)
        if not isinstance(challenge, Challenge):
            raise LinkError(f"it sent a {type(challenge).__name__} first, not a Challenge")
        if challenge.protocol != PROTOCOL_VERSION:
            raise ValueError(f"{head} speaks control protocol {challenge.protocol}, this host {PROTOCOL_VERSION}: run the same Sonar version on every host")
        if secret is not None and not challenge.authenticated:
            raise ValueError(f"{head} does not authenticate its followers but this host has {SECRET_ENV} set: set it on the head too")
        hello = Hello(
            protocol=PROTOCOL_VERSION, node_rank=config.node_rank, host=socket.gethostname(),
            config=comparable_config(config), model_fingerprint=model_fingerprint(config.model),
            nonce=nonce, proof=prove(secret, challenge.nonce, FOLLOWER) if secret is not None else b"",
        )
        send_message(sock, hello)
        verdict = receive_message(sock, MAX_GREETING_BYTES)
    except (LinkError, TimeoutError) as exc:
        sock.close()
        raise RuntimeError(f"{head} did not answer this host's introduction ({exc})") from None
    except ValueError:
        sock.close()
        raise
    if not isinstance(verdict, Verdict) or not verdict.accepted:
        sock.close()
        reason = verdict.reason if isinstance(verdict, Verdict) else f"it answered a {type(verdict).__name__}"
        raise ValueError(f"{head} refused node rank {config.node_rank}: {reason}")
    if secret is not None and not proves(secret, nonce, HEAD, verdict.proof):
        sock.close()
        raise ValueError(f"{head} did not prove this host's {SECRET_ENV}: it is not the head this host was told to join")
    sock.settimeout(None)
    keep_alive(sock)
    return sock


class RankRelay:
    """This host's ranks, and the relay between them and the head's control link."""

    def __init__(self, config: EngineConfig, layout: NodeLayout, platform: type[Platform], link: socket.socket) -> None:
        self.layout = layout
        self.link = link
        self.step_timeout_s = _timeout(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)
        self.ring = RingWriter(layout.num_local_ranks, slot_bytes=_ring_slot_bytes())
        self.processes: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        try:
            for local_rank, rank in enumerate(layout.ranks):
                self._start_rank(config, platform, rank, local_rank)
        except BaseException:
            self.shutdown()
            raise

    def _start_rank(self, config: EngineConfig, platform: type[Platform], rank: int, local_rank: int) -> None:
        ours, theirs = socket.socketpair()
        self.processes.append(subprocess.Popen(
            [
                sys.executable, "-m", "sonar.executor.multiproc", str(rank), str(self.layout.world_size),
                rendezvous_address(config), str(theirs.fileno()), logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            ],
            pass_fds=(theirs.fileno(),), env={**os.environ, **platform.rank_env(local_rank, self.layout.num_local_ranks)},
        ))
        theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(msgspec.json.encode(config))
        conn.send_bytes(encode_ring_info(self.ring, local_rank))
        self.conns.append(conn)

    def run(self) -> int:
        """Relay until the head shuts down (0) or a rank exits (1).

        :raises LinkError: the head is gone (the link closed or carried an invalid frame).
        """
        selector = selectors.DefaultSelector()
        selector.register(self.link, selectors.EVENT_READ, None)
        for index, conn in enumerate(self.conns):
            selector.register(conn, selectors.EVENT_READ, index)
        alive = lambda: all(process.poll() is None for process in self.processes)  # noqa: E731
        while True:
            for key, _ in selector.select(IDLE_CHECK_S):
                if key.data is None:
                    message = receive_message(self.link)
                    if isinstance(message, Shutdown):
                        return 0
                    self._broadcast(message, alive)
                    continue
                try:
                    data = self.conns[key.data].recv_bytes()
                except (EOFError, OSError):
                    return self._rank_exited(key.data)
                send_message(self.link, Reply(self.layout.first_rank + key.data, data))
            for index, process in enumerate(self.processes):
                if process.poll() is not None:
                    return self._rank_exited(index)

    def _broadcast(self, message: Any, alive: Any) -> None:
        if not isinstance(message, Broadcast):
            raise LinkError(f"the head sent an unexpected {type(message).__name__}")
        try:
            if self.ring.write(message.data, timeout_s=self.step_timeout_s, alive=alive):
                return
            self.ring.write(OVERFLOW, timeout_s=self.step_timeout_s, alive=alive)
        except RingTimeout:
            return  # a rank is gone or stuck: the loop notices its exit
        for conn in self.conns:
            try:
                conn.send_bytes(message.data)
            except OSError:
                return

    def _rank_exited(self, index: int) -> int:
        rank = self.layout.first_rank + index
        try:
            code = self.processes[index].wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        logger.error("rank %d exited (exit code %s); stopping this host's ranks and leaving the group", rank, code)
        try:
            send_message(self.link, RankExited(rank, code))
        except LinkError:
            pass
        return 1

    def shutdown(self) -> None:
        """Stop the ranks: close their sockets (they exit), kill any that lingers."""
        stop_ranks(self.conns, self.processes, self.ring)
        self.ring.unlink()
