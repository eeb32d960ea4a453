"""``NixlConnector`` (vLLM's name): prefill/decode disaggregation over NIXL, decode pulls.

The semantics are ``SonarConnector``'s: a prefill engine (``kv_role`` ``kv_producer`` or
``kv_both``) that finishes a request sent with ``kv_transfer_params: {"do_remote_decode":
true}`` keeps its blocks and returns, in its response's ``kv_transfer_params``, where they are
(its side-channel port, the request, the block ids, the prompt's length and hash). A decode
engine (``kv_consumer`` or ``kv_both``) given those parameters reads the blocks before it
schedules the request, computes only the last prompt token and decodes from there.

What differs is how the blocks move. Each engine registers its KV-cache tensors (host memory
on the CPU, device memory on a GPU) with a NIXL agent. The decode engine asks the prefill
engine's side channel (``sonar.kv_transfer.nixl_wire``: msgspec over TCP) for its agent
metadata and cache layout, which must match its own, then READs the request's blocks, keys
and values of every layer, straight into its own blocks (UCX picks the path: shared memory or
TCP between host processes, CUDA IPC or RDMA between GPUs). The transfer's notification tells
the prefill engine to free the blocks; it frees them anyway after ``kv_transfer_timeout``
seconds (``kv_connector_extra_config``, default 30) when nobody reads them.

A decode engine whose pull fails (the prefill engine is gone or refused the layout, NIXL
reported an error, the read did not finish in time) computes the prompt itself: the output
is the same, only slower, and ``sonar:kv_transfer_failures`` counts it.

NIXL gives a peer that holds the prefill engine's metadata read access to its whole
registered cache: serve the side channel (``kv_ip``) on a network only the engines share.

``kv_connector_extra_config``: ``kv_transfer_timeout`` (seconds), ``backends`` (NIXL
backends, default ``["UCX"]``) and ``progress_thread`` (NIXL's own progress thread, which keeps
a core busy polling; default off: the decode side drives its reads and the prefill side reads
its notifications every millisecond while it serves blocks).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sonar.kv_transfer import kv_wire, nixl_wire
from sonar.kv_transfer.interface import KVCacheLayout, KVConnectorMetadata, KVConnectorRole, KVTransferConfig
from sonar.kv_transfer.kv_wire import KVWireError
from sonar.kv_transfer.pull_scheduling import PullScheduling

if TYPE_CHECKING:
    import numpy as np
    import torch

    from sonar.engine.request import Request
    from sonar.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

# the package's import names: ``nixl`` (the meta package), or the CUDA-versioned wheels themselves
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_BACKENDS = ("UCX",)
EXTRA_CONFIG_KEYS = ("backends", "kv_transfer_timeout", "progress_thread")
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0
MAX_PULL_THREADS = 4
POLL_S = 0.0005  # between checks of a transfer in flight
NOTIFY_POLL_S = 0.001  # between reads of the notifications while blocks are served
IDLE_NOTIFY_POLL_S = 0.1
EXPIRY_MARGIN_S = 0.5  # a read ends at least this long before the prefill side would free its blocks
MAX_EARLY_FREES = 4096  # notifications that came before the worker heard of their request


def nixl_module_name() -> str | None:
    """The NIXL package importable here (None: none is installed)."""
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def nixl_api() -> ModuleType:
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``)."""
    errors = []
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as exc:  # a wheel whose native libraries do not load here
            errors.append(f"{name}: {exc}")
    raise RuntimeError("NIXL does not import here: " + ("; ".join(errors) or "no nixl package is installed"))


@dataclass(slots=True)
class NixlLoad:
    """Blocks of one request to read from a prefill engine into ``block_ids``."""

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class NixlRelease:
    """A prefill engine's blocks that this engine needs none of (its own prefix cache holds the
    prompt): the prefill engine is told to free them."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str


@dataclass(slots=True)
class NixlConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, list[int]] = field(default_factory=dict)  # finished prefills whose blocks a peer reads
    loads: list[NixlLoad] = field(default_factory=list)
    releases: list[NixlRelease] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.sends or self.loads or self.releases)


@dataclass(slots=True)
class _Peer:
    """A prefill engine's agent, added to this engine's, and its cache's descriptors."""

    agent_name: str
    engine_id: str
    num_blocks: int
    descriptors: Any  # the prepped descriptor list of its every block (nixl_prepped_dlist_handle)


class NixlConnector(PullScheduling):
    """Prefill/decode transfers over NIXL (see the module's description)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout | None = None) -> None:
        super().__init__(config, role, layout)
        if layout is None:
            raise ValueError("NixlConnector needs the engine's KV-cache layout")
        extra = config.kv_connector_extra_config
        self.timeout_s = float(extra.get("kv_transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S))
        self.backends = list(extra.get("backends", DEFAULT_BACKENDS))
        self.progress_thread = bool(extra.get("progress_thread", False))
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        self._releases: list[NixlRelease] = []  # scheduler side: prefills to free unread
        # worker side
        self.kv_caches: list[torch.Tensor] = []
        self._agent = None
        self._agent_name = ""
        self._registered = None
        self._local_descriptors = None
        self._block_bytes = 0
        self._lock = threading.Lock()
        self._served: dict[str, float] = {}  # request -> when its blocks are freed unread
        self._early_frees: dict[str, float] = {}  # freed before the send was registered -> when heard
        self._expired: OrderedDict[str, None] = OrderedDict()  # the latest requests freed unread, oldest first
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: set[str] = set()
        self._peers: dict[str, _Peer] = {}  # by agent name
        self._peer_at: dict[tuple[str, int], str] = {}  # side-channel address -> agent name
        self._peers_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        if nixl_module_name() is None:
            raise ValueError(
                "kv_connector 'NixlConnector' needs the nixl package, which is not installed here "
                "(pip install nixl, on hosts with its UCX transports); 'SonarConnector' needs nothing installed"
            )
        extra = config.kv_connector_extra_config
        timeout = extra.get("kv_transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"kv_connector_extra_config['kv_transfer_timeout'] must be a positive number of seconds, got {timeout!r}")
        backends = extra.get("backends", list(DEFAULT_BACKENDS))
        if not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends):
            raise ValueError(f"kv_connector_extra_config['backends'] must be a list of NIXL backend names (e.g. [\"UCX\"]), got {backends!r}")
        if not isinstance(extra.get("progress_thread", False), bool):
            raise ValueError(f"kv_connector_extra_config['progress_thread'] must be true or false, got {extra['progress_thread']!r}")
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} for NixlConnector; known: {', '.join(EXTRA_CONFIG_KEYS)}"
            )

    # -- scheduler side --------------------------------------------------------------------

    def make_load(self, request_id: str, params: dict[str, Any], remote_block_ids: list[int], block_ids: list[int]) -> NixlLoad:
        return NixlLoad(
            request_id, params["remote_engine_id"], params["remote_host"], params["remote_port"], params["remote_request_id"],
            remote_block_ids, block_ids,
        )

    def nothing_to_pull(self, request: Request, params: dict[str, Any]) -> None:
        """The prefill engine need not keep its copy: it is told to free it."""
        self._attempted.add(request.request_id)
        self._releases.append(NixlRelease(params["remote_engine_id"], params["remote_host"], params["remote_port"], params["remote_request_id"]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        metadata = NixlConnectorMetadata(self._sends, self._loads, self._releases)
        self._sends, self._loads, self._releases = {}, [], []
        self.forget_finished(scheduler_output)
        return metadata

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Register the caches with a new NIXL agent and describe each block of each (keys and
        values of every layer); a producer then serves its side channel, a consumer starts its
        pull threads.

        :raises RuntimeError: NIXL does not load, or none of the configured backends starts.
        :raises ValueError: the caches are not contiguous tensors on one device.
        """
        first = kv_caches[0]
        if any(not kv.is_contiguous() or kv.device != first.device or kv.shape != first.shape for kv in kv_caches):
            raise ValueError("NixlConnector registers contiguous KV caches of one shape on one device")
        api = nixl_api()
        self.kv_caches = kv_caches
        self._agent_name = f"sonar-{self.engine_id}-{uuid.uuid4().hex[:8]}"
        agent_config = api.nixl_agent_config(
            enable_prog_thread=self.progress_thread, backends=self.backends, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        agent = api.nixl_agent(self._agent_name, agent_config)
        if not agent.backends:
            raise RuntimeError(f"NIXL started none of the backends {self.backends} (available here: {agent.get_plugin_list()})")
        self._agent = agent
        self._registered = agent.register_memory(kv_caches)
        self._block_bytes = first[0, 0].numel() * first.element_size()  # [block_size, heads, head_dim]
        self._local_descriptors = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descriptors([kv.data_ptr() for kv in kv_caches], first.shape[1], self._block_bytes, _device_id(first)),
            _mem_type(first),
        )
        logger.info("NIXL agent %s: %d layers of %d blocks registered (%s)", self._agent_name, len(kv_caches), first.shape[1], _mem_type(first))
        if self.config.is_consumer:
            self._pool = ThreadPoolExecutor(MAX_PULL_THREADS, thread_name_prefix="sonar-nixl-pull")
        if self.config.is_producer:
            listener = socket.create_server((self.config.kv_ip, self.config.kv_port), reuse_port=False)
            self._listener = listener
            threading.Thread(target=self._serve, name="sonar-nixl-side-channel", daemon=True).start()
            threading.Thread(target=self._watch_notifications, name="sonar-nixl-notifications", daemon=True).start()
            logger.info("NIXL side channel listening on %s:%d", *listener.getsockname()[:2])

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        if self._listener is None:
            return None
        host = self.config.kv_ip
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return {"host": host, "port": self._listener.getsockname()[1], "engine_id": self.engine_id}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, NixlConnectorMetadata) or not metadata.has_work:
            return
        if metadata.sends:
            deadline = time.monotonic() + self.timeout_s
            with self._lock:
                for req_id in metadata.sends:
                    if self._early_frees.pop(req_id, None) is not None:
                        self._done_sending.add(req_id)  # read before this worker heard of it
                    else:
                        self._served[req_id] = deadline
        for load in metadata.loads:
            if self._pool is None:  # not a consumer: nothing to read with
                self._finish_recv(load.request_id, ok=False)
            else:
                self._pool.submit(self._pull, load)
        if self._pool is not None:
            for release in metadata.releases:
                self._pool.submit(self._release, release)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, deadline in self._served.items() if deadline < now]:
                logger.warning("request %s: no decode engine read its KV within %.0f s; its blocks are freed", req_id, self.timeout_s)
                del self._served[req_id]
                self._done_sending.add(req_id)
                self._expired[req_id] = None
                if len(self._expired) > MAX_EARLY_FREES:
                    self._expired.popitem(last=False)
            for req_id in [r for r, heard in self._early_frees.items() if heard + self.timeout_s < now]:
                del self._early_frees[req_id]
            sending, recving = self._done_sending, self._done_recving
            self._done_sending, self._done_recving = set(), set()
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- prefill side ------------------------------------------------------------------------

    def _watch_notifications(self) -> None:
        """Collect the decode engines' notifications, every millisecond while blocks are
        served (which also moves NIXL's transfers along where no progress thread runs), ten
        times a second otherwise."""
        self._use_cache_device()
        while not self._closed:
            with self._lock:
                serving = bool(self._served)
            time.sleep(NOTIFY_POLL_S if serving else IDLE_NOTIFY_POLL_S)
            self._collect_frees()

    def _collect_frees(self) -> None:
        """Free the blocks the decode engines' notifications name."""
        try:
            notifications = self._agent.get_new_notifs()
        except Exception as exc:
            if not self._closed:
                logger.warning("NIXL: reading notifications failed: %s", exc)
            return
        if not notifications:
            return
        now = time.monotonic()
        for agent_name, messages in notifications.items():
            for message in messages:
                req_id = nixl_wire.decode_free(message)
                if req_id is None:
                    logger.warning("NIXL: agent %s sent a notification that is not a free: %r", agent_name, message[:64])
                else:
                    self._free(req_id, now)

    def _free(self, req_id: str, now: float) -> None:
        """A decode engine is done with ``req_id``'s blocks: they go at the next step (or
        once the send is registered, if this came first)."""
        with self._lock:
            if self._served.pop(req_id, None) is not None:
                self._done_sending.add(req_id)
            elif len(self._early_frees) < MAX_EARLY_FREES:
                self._early_frees[req_id] = now

    def _serve(self) -> None:
        listener = self._listener
        while not self._closed:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, peer), name="sonar-nixl-hello", daemon=True).start()

    def _handle(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                self._answer_hello(conn)
            except Exception as exc:  # malformed input or a peer gone: this connection ends, the port lives on
                logger.warning("NIXL side channel: connection from %s closed: %s", peer, exc)

    def _answer_hello(self, conn: socket.socket) -> None:
        hello = nixl_wire.recv_message(conn, (nixl_wire.NixlHello, nixl_wire.NixlFree, kv_wire.Hello))
        if isinstance(hello, nixl_wire.NixlFree):
            if hello.engine_id == self.engine_id:
                self._free(hello.request_id, time.monotonic())
            return
        if isinstance(hello, kv_wire.Hello):  # a SonarConnector engine
            error = "this KV port is a NixlConnector's; give the decode engine kv_connector 'NixlConnector' too"
            kv_wire.send_message(conn, kv_wire.HelloReply(False, self.engine_id, error))
            logger.warning("NIXL side channel: refused engine %s: %s", hello.engine_id, error)
            return
        mismatches = self._layout_mismatches(hello)
        if mismatches:
            error = "KV layouts differ (prefill vs decode): " + "; ".join(mismatches)
            nixl_wire.send_message(conn, nixl_wire.NixlHelloReply(False, self.engine_id, error))
            logger.warning("NIXL side channel: refused engine %s: %s", hello.engine_id, error)
            return
        with self._lock:
            expired = hello.request_id in self._expired
            deadline = self._served.get(hello.request_id)
        if expired:
            error = f"request {hello.request_id!r}'s blocks were freed unread after kv_transfer_timeout ({self.timeout_s:g} s)"
            nixl_wire.send_message(conn, nixl_wire.NixlHelloReply(False, self.engine_id, error))
            return
        first = self.kv_caches[0]
        reply = nixl_wire.NixlHelloReply(
            True, self.engine_id,
            expires_in_s=self.timeout_s if deadline is None else deadline - time.monotonic(),  # None: not registered yet
            agent_name=self._agent_name,
            agent_metadata=self._agent.get_agent_metadata(),
            mem_type=_mem_type(first),
            device_id=_device_id(first),
            layer_addresses=[kv.data_ptr() for kv in self.kv_caches],
            num_blocks=first.shape[1],
            block_bytes=self._block_bytes,
        )
        nixl_wire.send_message(conn, reply)

    def _layout_mismatches(self, hello: nixl_wire.NixlHello) -> list[str]:
        if hello.version != nixl_wire.PROTOCOL_VERSION:
            return [f"protocol version {nixl_wire.PROTOCOL_VERSION} != {hello.version}"]
        theirs = KVCacheLayout(
            hello.model, hello.dtype, hello.block_size, hello.num_layers, hello.num_kv_heads, hello.head_dim, 0,
            hello.tensor_parallel_size,
        )
        return self.layout.mismatches(theirs)

    # -- decode side -------------------------------------------------------------------------

    def _pull(self, load: NixlLoad) -> None:
        ok = False
        try:
            self._use_cache_device()
            self._read_blocks(load)
            ok = True
        except Exception as exc:  # a failed pull recomputes; it never takes the engine down
            logger.warning(
                "request %s: reading its KV from %s:%s over NIXL failed (%s); its prompt is computed here",
                load.request_id, load.remote_host, load.remote_port, exc,
            )
        self._finish_recv(load.request_id, ok)

    def _release(self, release: NixlRelease) -> None:
        self._send_free(release.remote_host, release.remote_port, release.remote_engine_id, release.remote_request_id)

    def _hello(self, request_id: str) -> nixl_wire.NixlHello:
        layout = self.layout
        return nixl_wire.NixlHello(
            nixl_wire.PROTOCOL_VERSION, self.engine_id, layout.model, layout.dtype, layout.block_size,
            layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.tensor_parallel_size, request_id,
        )

    def _ask(self, host: str, port: int, request_id: str) -> nixl_wire.NixlHelloReply:
        """The prefill engine's side channel's answer to this engine's hello about the blocks
        of its request ``request_id``.

        :raises KVWireError: it refused (the message says why) or answered wrongly.
        :raises OSError: nothing answers there.
        """
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(IO_TIMEOUT_S)
            nixl_wire.send_message(sock, self._hello(request_id))
            try:
                reply = nixl_wire.recv_message(sock, nixl_wire.NixlHelloReply)
            except KVWireError as exc:
                raise KVWireError(f"{exc} (is the prefill engine's kv_connector NixlConnector too?)") from None
        if not reply.ok:
            raise KVWireError(f"the prefill engine refused: {reply.error}")
        return reply

    def _read_blocks(self, load: NixlLoad) -> None:
        reply = self._ask(load.remote_host, load.remote_port, load.remote_request_id)
        if reply.engine_id != load.remote_engine_id:
            raise KVWireError(f"engine {reply.engine_id!r} serves that port now, not {load.remote_engine_id!r}, whose blocks these were")
        # the read must end before the prefill side frees the blocks (and may reuse them)
        budget_s = min(self.timeout_s, reply.expires_in_s - EXPIRY_MARGIN_S)
        if not budget_s > 0:
            raise KVWireError(f"the prefill engine frees the blocks in {reply.expires_in_s:.2f} s: too soon to read them")
        peer = self._peer(reply, (load.remote_host, load.remote_port))
        try:
            if len(load.remote_block_ids) != len(load.block_ids):
                raise KVWireError(f"{len(load.remote_block_ids)} remote blocks for {len(load.block_ids)} local ones")
            if any(b >= peer.num_blocks for b in load.remote_block_ids):
                raise KVWireError(f"a remote block id beyond the prefill engine's {peer.num_blocks} blocks")
        except KVWireError:
            self._send_free(load.remote_host, load.remote_port, reply.engine_id, load.remote_request_id)  # nothing will read them
            raise
        try:
            self._transfer(peer, load, budget_s)
        except Exception:
            self._forget(peer)
            # whatever it read, the prefill side may free them (if it still can hear it)
            self._send_free(load.remote_host, load.remote_port, reply.engine_id, load.remote_request_id)
            raise

    def _transfer(self, peer: _Peer, load: NixlLoad, budget_s: float) -> None:
        agent = self._agent
        local = _block_indices(load.block_ids, len(self.kv_caches), self.kv_caches[0].shape[1])
        remote = _block_indices(load.remote_block_ids, len(self.kv_caches), peer.num_blocks)
        notification = nixl_wire.encode_free(load.remote_request_id)
        handle = agent.make_prepped_xfer("READ", self._local_descriptors, local, peer.descriptors, remote, notification)
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + budget_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the read did not finish in {budget_s:.1f} s")
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVWireError(f"NIXL reported the read as {state}")
        finally:
            self._release_transfer(handle)

    def _release_transfer(self, handle: Any) -> None:
        """Release a transfer; one NIXL cannot cancel is waited for first (for a while), so
        that it no longer writes into blocks the prompt is about to be computed into."""
        try:
            handle.release()
            return
        except Exception as exc:
            logger.warning("NIXL: a read could not be cancelled (%s); waiting for it to end", exc)
        deadline = time.monotonic() + IO_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self._agent.check_xfer_state(handle) != "PROC":
                    break
            except Exception:
                break
            time.sleep(POLL_S)
        try:
            handle.release()
        except Exception as exc:
            logger.error("NIXL: a read still runs after %.0f s; its blocks may be written late: %s", IO_TIMEOUT_S, exc)

    def _peer(self, reply: nixl_wire.NixlHelloReply, address: tuple[str, int]) -> _Peer:
        """The prefill engine's agent as this engine knows it: added (once per agent) from
        what its side channel answered, after checking that answer against this cache."""
        problem = self._check_reply(reply)
        if problem:
            raise KVWireError(f"the prefill engine described its cache wrongly: {problem}")
        with self._peers_lock:
            peer = self._peers.get(reply.agent_name)
            if peer is not None:
                if peer.num_blocks != reply.num_blocks:
                    raise KVWireError(f"agent {reply.agent_name} now says {reply.num_blocks} blocks, earlier {peer.num_blocks}")
                return peer
            previous = self._peer_at.get(address)
            if previous in self._peers:  # that port's engine restarted: its old agent is gone
                self._forget_locked(self._peers[previous])
            added = self._agent.add_remote_agent(reply.agent_metadata)
            added = added.decode() if isinstance(added, bytes) else str(added)
            if added != reply.agent_name:
                self._agent.remove_remote_agent(added)
                raise KVWireError(f"the agent metadata names {added!r}, not {reply.agent_name!r}")
            try:  # NIXL refuses descriptors outside the memory the peer registered
                descriptors = self._agent.prep_xfer_dlist(
                    added, _block_descriptors(reply.layer_addresses, reply.num_blocks, reply.block_bytes, reply.device_id), reply.mem_type
                )
            except Exception as exc:
                self._agent.remove_remote_agent(added)
                raise KVWireError(f"its cache does not match the memory its agent registered ({exc})") from None
            try:  # connected now, so that a notification sent before any read gets through
                self._agent.make_connection(added)
            except Exception as exc:
                logger.debug("NIXL: connecting to agent %s ahead of a read failed: %s", added, exc)
            peer = _Peer(added, reply.engine_id, reply.num_blocks, descriptors)
            self._peers[added] = peer
            self._peer_at[address] = added
            logger.info("NIXL: added agent %s (engine %s, %d blocks)", added, reply.engine_id, reply.num_blocks)
            return peer

    def _check_reply(self, reply: nixl_wire.NixlHelloReply) -> str | None:
        first = self.kv_caches[0]
        if not reply.agent_name or len(reply.agent_name) > 256 or not reply.agent_metadata:
            return "no agent name or metadata"
        if reply.mem_type != _mem_type(first):
            return f"its cache is in {reply.mem_type!r} memory, this one's in {_mem_type(first)!r}"
        if len(reply.layer_addresses) != len(self.kv_caches):
            return f"{len(reply.layer_addresses)} layer addresses for {len(self.kv_caches)} layers"
        if reply.block_bytes != self._block_bytes:
            return f"blocks of {reply.block_bytes} bytes, not {self._block_bytes}"
        if not 0 < reply.num_blocks < 1 << 31 or not 0 <= reply.device_id < 1 << 16:
            return f"{reply.num_blocks} blocks on device {reply.device_id}"
        span = 2 * reply.num_blocks * reply.block_bytes
        if any(not 0 < address < (1 << 64) - span for address in reply.layer_addresses):
            return "a layer address out of range"
        return None

    def _send_free(self, host: str, port: int, engine_id: str, remote_request_id: str) -> None:
        """Tell the prefill engine at ``host:port`` that its blocks of ``remote_request_id``
        will not be read (best effort: it frees them after its timeout anyway)."""
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
                sock.settimeout(IO_TIMEOUT_S)
                nixl_wire.send_message(sock, nixl_wire.NixlFree(remote_request_id, engine_id))
        except OSError as exc:  # the peer is gone: its blocks went with it
            logger.debug("telling %s:%s to free %s failed: %s", host, port, remote_request_id, exc)

    def _forget(self, peer: _Peer) -> None:
        """Drop a peer after a failed transfer: the next pull adds it afresh."""
        with self._peers_lock:
            if self._peers.get(peer.agent_name) is peer:
                self._forget_locked(peer)

    def _forget_locked(self, peer: _Peer) -> None:
        del self._peers[peer.agent_name]
        try:
            peer.descriptors.release()
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:
            logger.debug("NIXL: removing agent %s: %s", peer.agent_name, exc)

    def _use_cache_device(self) -> None:
        """Make the cache's GPU current in this thread (UCX's CUDA transports work in the
        calling thread's context)."""
        device = self.kv_caches[0].device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    def _finish_recv(self, req_id: str, ok: bool) -> None:
        with self._lock:
            self._done_recving.add(req_id)
            if not ok:
                self._failed.add(req_id)


def _mem_type(tensor: torch.Tensor) -> str:
    return "DRAM" if tensor.device.type == "cpu" else "VRAM"


def _device_id(tensor: torch.Tensor) -> int:
    return 0 if tensor.device.type == "cpu" else tensor.device.index or 0


def _block_descriptors(layer_addresses: list[int], num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """One ``(address, length, device)`` row per block of keys and of values of every layer:
    row ``(layer * 2 + kv) * num_blocks + block`` (each layer's cache is ``[2, num_blocks,
    block_size, heads, head_dim]``)."""
    import numpy as np

    offsets = np.arange(2 * num_blocks, dtype=np.uint64) * np.uint64(block_bytes)  # [2 * num_blocks]
    bases = np.array(layer_addresses, dtype=np.uint64)[:, None]  # [num_layers, 1]
    rows = np.empty((len(layer_addresses) * 2 * num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = (bases + offsets).reshape(-1)
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows


def _block_indices(block_ids: list[int], num_layers: int, num_blocks: int) -> np.ndarray:
    """The rows of ``_block_descriptors`` that hold ``block_ids``, layer by layer, keys then
    values (the order both sides of a transfer use)."""
    import numpy as np

    blocks = np.asarray(block_ids, dtype=np.int64)
    regions = np.arange(2 * num_layers, dtype=np.int64)[:, None] * num_blocks  # [2 * num_layers, 1]
    return (regions + blocks).reshape(-1).astype(np.int32)
