"""One model's ranks over several hosts ("nodes"), without Ray.

The ranks are split evenly: with ``world_size`` ranks on ``nnodes`` hosts, host ``n`` runs
ranks ``n * L .. n * L + L - 1`` (``L = world_size / nnodes``). Every rank joins
``torch.distributed`` at ``tcp://master_addr:master_port`` (rank 0, on the head, hosts the
rendezvous). The head (node rank 0) runs the engine core; its ``mp`` executor starts its own
ranks as on one host and reaches each follower host over one TCP connection, the control
link, which the head listens for at ``master_addr:master_port + 1``:

- **Head.** ``accept_followers`` waits (``SONAR_WORKER_STARTUP_TIMEOUT_S``) for every follower
  to connect and checks it runs the same model and engine options (``node_wire.Hello``);
  a mismatch is refused with the differences, on both sides. Then one *link process* per
  follower stands in for that host's ranks: it reads the executor's shared-memory ring like
  a local rank and forwards each message over the link, and hands each remote rank's replies
  to the executor through a Unix socket of that rank's, exactly where a local rank's come
  from. The executor cannot tell them apart: a follower that goes away closes its link, the
  link process exits, and the executor fails with ``WorkerDiedError`` as for a dead local
  rank.
- **Follower.** ``sonar.executor.node_follower.run_follower`` (``sonar serve ... --headless``) connects to the head,
  introduces itself, starts its ranks once the head says so, and relays: each message from
  the head is written once into its own shared-memory ring (or, larger than a slot, to each
  rank's socket); each rank's reply goes back over the link. The head gone (link closed) or
  a rank dead stops every rank of the host and ends the follower.

Every frame on the link is plain data (``sonar.executor.node_wire``), checked for size and type.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from sonar.config import EngineConfig
from sonar.executor.base import WorkerDiedError
from sonar.executor.multiproc import DEFAULT_STARTUP_TIMEOUT_S, IDLE_CHECK_S, OVERFLOW, STARTUP_TIMEOUT_ENV, STOP, _peer_closed, _timeout
from sonar.executor.node_wire import (
    FOLLOWER, HEAD, MAX_GREETING_BYTES, PROTOCOL_VERSION, SECRET_ENV, Broadcast, Challenge, Hello, LinkError, RankExited,
    Reply, Shutdown, Start, Verdict, comparable_config, config_differences, keep_alive, model_fingerprint, new_nonce,
    node_secret, prove, proves, receive_message, send_message,
)
from sonar.executor.shm_broadcast import RingReader, RingTimeout, RingWriter

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection that does not introduce itself within this is dropped


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which ranks of a ``world_size`` group host ``node_rank`` of ``nnodes`` runs."""

    world_size: int
    nnodes: int
    node_rank: int

    def __post_init__(self) -> None:
        if self.world_size % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"cannot split {self.world_size} ranks evenly over {self.nnodes} hosts as node rank {self.node_rank}")

    @property
    def num_local_ranks(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.num_local_ranks

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_local_ranks)


def rendezvous_address(config: EngineConfig) -> str:
    """Where every rank of every host joins ``torch.distributed``."""
    return f"tcp://{_url_host(config.master_addr)}:{config.master_port}"


def control_port(config: EngineConfig) -> int:
    """The port of the head's control link: the one after the rendezvous port."""
    return config.master_port + 1


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _restart_hint(config: EngineConfig, node_rank: int | str) -> str:
    return (
        f"sonar serve <model> <the head's engine flags> --nnodes {config.nnodes} --node-rank {node_rank} "
        f"--master-addr {config.master_addr} --master-port {config.master_port} --headless"
    )


# -- the head ------------------------------------------------------------------------------


class FollowerLink:
    """A follower host the head accepted: its control link and its ranks."""

    def __init__(self, sock: socket.socket, layout: NodeLayout, host: str) -> None:
        self.sock = sock
        self.layout = layout
        self.host = host

    def start_link_process(self, ring: RingWriter, reader_index: int) -> tuple[subprocess.Popen, list[socket.socket]]:
        """Tell the follower to start its ranks, then hand the link to a process that stands
        in for them; returns the process and the executor's end of each rank's socket."""
        send_message(self.sock, Start())
        ours, theirs = zip(*(socket.socketpair() for _ in self.layout.ranks))
        fds = [self.sock.fileno(), *(sock.fileno() for sock in theirs)]
        setup = LinkSetup(
            node_rank=self.layout.node_rank, first_rank=self.layout.first_rank, host=self.host, link_fd=fds[0],
            rank_fds=fds[1:], ring_name=ring.name, reader_index=reader_index, num_readers=ring.num_readers,
            num_slots=ring.num_slots, slot_bytes=ring.slot_bytes,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "sonar.executor.multinode", msgspec.json.encode(setup).decode()], pass_fds=fds,
        )
        for sock in (self.sock, *theirs):
            sock.close()
        return process, list(ours)


def accept_followers(config: EngineConfig, world_size: int) -> list[FollowerLink]:
    """Listen at the control port until every follower host has connected and matches the
    head; returns them by node rank. Refused followers are told why and may reconnect.

    :raises WorkerDiedError: a follower did not connect within the startup timeout.
    """
    timeout_s = _timeout(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S)
    expected = comparable_config(config)
    fingerprint = model_fingerprint(config.model)
    address = (config.master_addr, control_port(config))
    followers: dict[int, FollowerLink] = {}
    family = socket.AF_INET6 if ":" in config.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(address)
        except OSError as exc:
            raise ValueError(
                f"the head cannot listen for its followers at {address[0]}:{address[1]} ({exc.strerror or exc}); "
                f"--master-addr must be this host's address and --master-port + 1 a free port"
            ) from None
        listener.listen(config.nnodes)
        logger.info("waiting for %d follower host(s) at %s:%d", config.nnodes - 1, *address)
        deadline = time.monotonic() + timeout_s
        while len(followers) < config.nnodes - 1:
            remaining = deadline - time.monotonic()
            listener.settimeout(max(0.0, remaining))
            try:
                if remaining <= 0:
                    raise TimeoutError
                sock, peer = listener.accept()
            except TimeoutError:
                missing = [rank for rank in range(1, config.nnodes) if rank not in followers]
                for follower in followers.values():
                    follower.sock.close()
                raise WorkerDiedError(
                    f"follower node rank(s) {missing} did not join the head at {address[0]}:{address[1]} within "
                    f"{timeout_s:.0f} s ({STARTUP_TIMEOUT_ENV}); start each with `{_restart_hint(config, 'R')}`"
                ) from None
            follower = _admit(sock, peer, config, world_size, expected, fingerprint, followers)
            if follower is not None:
                followers[follower.layout.node_rank] = follower
    return [followers[rank] for rank in sorted(followers)]


def _admit(
    sock: socket.socket, peer: Any, config: EngineConfig, world_size: int, expected: dict[str, Any], fingerprint: str,
    followers: dict[int, FollowerLink],
) -> FollowerLink | None:
    """Challenge a connection, read its ``Hello`` and answer it: the accepted follower, or None."""
    sock.settimeout(HELLO_TIMEOUT_S)
    secret = node_secret()
    nonce = new_nonce()
    try:
        send_message(sock, Challenge(PROTOCOL_VERSION, nonce, authenticated=secret is not None))
        hello = receive_message(sock, MAX_GREETING_BYTES)
        if not isinstance(hello, Hello):
            raise LinkError(f"expected a Hello first, got a {type(hello).__name__}")
        reason = _refusal(hello, config, expected, fingerprint, followers, secret=secret, nonce=nonce)
        proof = prove(secret, hello.nonce, HEAD) if secret is not None and reason is None else b""
        send_message(sock, Verdict(accepted=reason is None, reason=reason or "", proof=proof))
    except (LinkError, TimeoutError, OSError) as exc:
        logger.warning("dropped a connection from %s to the control link: %s", peer, exc)
        sock.close()
        return None
    if reason is not None:
        logger.error("refused follower %s (node rank %d) from %s: %s", hello.host, hello.node_rank, peer, reason)
        sock.close()
        return None
    sock.settimeout(None)
    keep_alive(sock)
    logger.info("follower node rank %d joined from %s", hello.node_rank, hello.host)
    return FollowerLink(sock, NodeLayout(world_size, config.nnodes, hello.node_rank), hello.host)


def _refusal(
    hello: Hello, config: EngineConfig, expected: dict[str, Any], fingerprint: str, followers: dict[int, FollowerLink],
    secret: bytes | None = None, nonce: bytes = b"",
) -> str | None:
    """Why ``hello``'s follower cannot join (None: it can). With a ``secret``, a follower that
    does not prove it over ``nonce`` learns nothing else."""
    if hello.protocol != PROTOCOL_VERSION:
        return f"it speaks control protocol {hello.protocol}, the head {PROTOCOL_VERSION}: run the same Sonar version on every host"
    if secret is not None and not proves(secret, nonce, FOLLOWER, hello.proof):
        return f"it did not prove the head's {SECRET_ENV}: set the same {SECRET_ENV} on every host"
    if not 1 <= hello.node_rank < config.nnodes:
        return f"node rank {hello.node_rank} is not a follower of nnodes={config.nnodes} (1..{config.nnodes - 1})"
    if hello.node_rank in followers:
        return f"node rank {hello.node_rank} has already joined (from {followers[hello.node_rank].host}); give each host its own --node-rank"
    differences = config_differences(expected, hello.config)
    if differences:
        return "its engine options differ from the head's (" + "; ".join(differences) + "): start it with the head's engine flags"
    if hello.model_fingerprint != fingerprint:
        return "its model files differ from the head's (config.json or the weight files' names and sizes): give it the same model"
    return None


# -- the link process (on the head, one per follower) ----------------------------------------


class LinkSetup(msgspec.Struct, forbid_unknown_fields=True):
    """What a link process is started with (JSON on its command line)."""

    node_rank: int
    first_rank: int
    host: str
    link_fd: int
    rank_fds: list[int]
    ring_name: str
    reader_index: int
    num_readers: int
    num_slots: int
    slot_bytes: int
    log_level: str


def run_link(setup: LinkSetup) -> int:
    """Forward the executor's messages to the follower and its ranks' replies back, until
    one side goes: 0 when the executor shut down, 1 when the follower was lost."""
    link = socket.socket(fileno=setup.link_fd)
    conns = [Connection(fd) for fd in setup.rank_fds]
    peer = socket.socket(fileno=os.dup(setup.rank_fds[0]))  # to tell the executor's exit
    ring = RingReader(setup.ring_name, setup.reader_index, setup.num_readers, setup.num_slots, setup.slot_bytes)
    done = threading.Event()
    sending = threading.Lock()  # one frame at a time on the link
    lost: list[str] = []
    last_rank = setup.first_rank + len(conns) - 1

    def downstream() -> None:  # executor -> follower
        try:
            while not done.is_set():
                try:
                    data = ring.read(IDLE_CHECK_S)
                except RingTimeout:
                    if _peer_closed(peer):
                        break
                    continue
                if data == STOP:  # the executor is shutting down: the follower's ranks stop as the link closes
                    break
                if data == OVERFLOW:  # every rank's socket got a copy: forward one
                    copies = [conn.recv_bytes() for conn in conns]
                    data = copies[0]
                with sending:
                    send_message(link, Broadcast(data))
        except (EOFError, OSError) as exc:  # the executor closed the sockets (LinkError is an OSError)
            if isinstance(exc, LinkError):
                lost.append(str(exc))
        finally:
            done.set()

    def upstream() -> None:  # follower -> executor
        try:
            while True:
                message = receive_message(link)
                if isinstance(message, Reply) and setup.first_rank <= message.rank <= last_rank:
                    conns[message.rank - setup.first_rank].send_bytes(message.data)
                elif isinstance(message, RankExited):
                    lost.append(f"its rank {message.rank} exited (exit code {message.exit_code})")
                    break
                else:
                    lost.append(f"it sent an unexpected {type(message).__name__} (ranks {setup.first_rank}..{last_rank})")
                    break
        except LinkError as exc:
            lost.append(str(exc))
        except OSError:  # the executor closed the sockets
            pass
        finally:
            done.set()

    for target in (downstream, upstream):
        threading.Thread(target=target, name=f"sonar-link-{target.__name__}", daemon=True).start()
    while not done.wait(0.2):
        if _peer_closed(peer):  # the executor shut down
            break
    if lost:
        logger.error(
            "lost follower node rank %d (%s, ranks %d..%d): %s", setup.node_rank, setup.host, setup.first_rank, last_rank, lost[0]
        )
    else:
        done.set()
        with sending:
            try:
                send_message(link, Shutdown())
            except LinkError:
                pass
    link.close()
    # the ring stays mapped until the process exits: the downstream thread may still be reading it
    return 1 if lost else 0


if __name__ == "__main__":
    from sonar.engine.process_util import exit_with_parent, set_process_title

    _setup = msgspec.json.decode(sys.argv[1], type=LinkSetup)
    exit_with_parent()
    set_process_title(f"node-link-{_setup.node_rank}")
    logging.basicConfig(level=_setup.log_level, format=f"%(asctime)s node-link {_setup.node_rank} %(levelname)s %(name)s: %(message)s")
    sys.exit(run_link(_setup))
