"""``SonarConnector``: prefill/decode disaggregation with nothing installed: over TCP between
hosts, through shared memory (CPU) or CUDA IPC (one GPU) between engines on one host.

A prefill engine (``kv_role`` ``kv_producer`` or ``kv_both``) that finishes a request sent with
``kv_transfer_params: {"do_remote_decode": true}`` keeps its blocks and returns, in its
response's ``kv_transfer_params``, where they are (its KV port, the request, the block ids, the
prompt's length and hash). A decode engine (``kv_consumer`` or ``kv_both``) given those
parameters pulls the blocks from that port before it schedules the request, computes only the
last prompt token and decodes from there.

The prefill side frees the blocks once they are pulled, or after ``kv_transfer_timeout``
seconds (``kv_connector_extra_config``, default 30) when nobody pulls them. A decode side whose
pull fails (the prefill engine is gone, refused the layout, timed out) computes the prompt
itself: the output is the same, only slower, and ``sonar:kv_transfer_failures`` counts it.

The wire format is ``sonar.kv_transfer.kv_wire``: msgspec headers and raw tensor frames. The
handshake always runs over the KV port; on one host the blocks themselves are then copied
straight out of the prefill engine's cache, which it shares read-only with same-user processes
(CPU) or through CUDA IPC (same GPU). ``kv_connector_extra_config["kv_transport"]`` = ``"tcp"``
keeps to frames.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sonar.kv_transfer import cuda_ipc, host_shm, kv_wire
from sonar.kv_transfer.interface import KVCacheLayout, KVConnectorMetadata, KVConnectorRole, KVTransferConfig
from sonar.kv_transfer.pull_scheduling import PullScheduling

if TYPE_CHECKING:
    import torch

    from sonar.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0
REGISTRATION_WAIT_S = 5.0  # a pull may arrive before the prefill side's worker heard of the request
MAX_PULL_THREADS = 4
# "auto": shared memory (CPU) or CUDA IPC (one GPU) between engines on one host, TCP frames
# otherwise; "tcp": always frames
TRANSPORTS = ("auto", "tcp")


@dataclass(slots=True)
class RemoteLoad:
    """Blocks of one request to pull from a prefill engine into ``block_ids``."""

    request_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class SonarConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, list[int]] = field(default_factory=dict)  # finished prefills whose blocks a peer pulls
    loads: list[RemoteLoad] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.sends or self.loads)


@dataclass(slots=True)
class _Served:
    block_ids: set[int]
    deadline: float


class SonarConnector(PullScheduling):
    """The built-in prefill/decode connector (see the module's description)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout | None = None) -> None:
        super().__init__(config, role, layout)
        if layout is None:
            raise ValueError("SonarConnector needs the engine's KV-cache layout")
        extra = config.kv_connector_extra_config
        self.timeout_s = float(extra.get("kv_transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S))
        self.same_host_transports = extra.get("kv_transport", "auto") == "auto"
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        # worker side
        self.kv_caches: list[torch.Tensor] = []
        self._lock = threading.Condition()
        self._served: dict[str, _Served] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed: set[str] = set()
        self._listener: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._host_id = cuda_ipc.host_identity()
        self._ipc_exports: list[kv_wire.CudaIpcHandle] | None = None  # prefill side, made at the first same-GPU peer
        self._ipc_imports: dict[str, list[torch.Tensor] | None] = {}  # decode side: per prefill engine (None: failed)
        self._pull_stream = None
        self._shared: host_shm.SharedKVCache | None = None  # prefill side on the CPU: the cache in shared memory
        self._shm_maps: dict[str, tuple[list[torch.Tensor], Any] | None] = {}  # decode side: per prefill engine
        self._pull_lock = threading.Lock()

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        timeout = config.kv_connector_extra_config.get("kv_transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"kv_connector_extra_config['kv_transfer_timeout'] must be a positive number of seconds, got {timeout!r}")
        transport = config.kv_connector_extra_config.get("kv_transport", "auto")
        if transport not in TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config['kv_transport'] must be one of {list(TRANSPORTS)}, got {transport!r}")

    # -- scheduler side --------------------------------------------------------------------

    def make_load(self, request_id: str, params: dict[str, Any], remote_block_ids: list[int], block_ids: list[int]) -> RemoteLoad:
        return RemoteLoad(request_id, params["remote_host"], params["remote_port"], params["remote_request_id"], remote_block_ids, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SonarConnectorMetadata:
        metadata = SonarConnectorMetadata(self._sends, self._loads)
        self._sends, self._loads = {}, []
        self.forget_finished(scheduler_output)
        return metadata

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        if self.config.is_consumer:
            self._pool = ThreadPoolExecutor(MAX_PULL_THREADS, thread_name_prefix="sonar-kv-pull")
        if self.config.is_producer:
            if self.same_host_transports and kv_caches and kv_caches[0].device.type == "cpu":
                try:
                    self._shared = host_shm.share_kv_caches(kv_caches, self.engine_id)
                except OSError as exc:
                    logger.warning("KV port: the KV cache cannot move to shared memory (%s); blocks go over TCP", exc)
            listener = socket.create_server((self.config.kv_ip, self.config.kv_port), reuse_port=False)
            self._listener = listener
            threading.Thread(target=self._serve, name="sonar-kv-port", daemon=True).start()
            logger.info("KV port listening on %s:%d", *listener.getsockname()[:2])

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        if self._listener is None:
            return None
        host = self.config.kv_ip
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        return {"host": host, "port": self._listener.getsockname()[1], "engine_id": self.engine_id}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, SonarConnectorMetadata) or not metadata.has_work:
            return
        if metadata.sends:
            deadline = time.monotonic() + self.timeout_s
            with self._lock:
                for req_id, block_ids in metadata.sends.items():
                    self._served[req_id] = _Served(set(block_ids), deadline)
                self._lock.notify_all()
        for load in metadata.loads:
            if self._pool is None:  # not a consumer: nothing to pull with
                self._finish_recv(load.request_id, ok=False)
            else:
                self._pool.submit(self._pull, load)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, served in self._served.items() if served.deadline < now]:
                logger.warning("request %s: no decode engine pulled its KV within %.0f s; its blocks are freed", req_id, self.timeout_s)
                del self._served[req_id]
                self._done_sending.add(req_id)
            sending, recving = self._done_sending, self._done_recving
            self._done_sending, self._done_recving = set(), set()
        return sending, recving

    def get_failed_loads(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self._closed = True
        if self._shared is not None:
            self._shared.close()
        if self._listener is not None:
            self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- decode side: pulling ----------------------------------------------------------------

    def _hello(self) -> kv_wire.Hello:
        layout = self.layout
        return kv_wire.Hello(
            kv_wire.PROTOCOL_VERSION, self.engine_id, layout.model, layout.dtype, layout.block_size,
            layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.tensor_parallel_size,
            host_id=self._host_id, device_uuid=cuda_ipc.device_uuid(self.kv_caches[0].device) if self.kv_caches else "",
        )

    def _pull(self, load: RemoteLoad) -> None:
        ok = False
        try:
            self._pull_blocks(load)
            ok = True
        except Exception as exc:  # a failed pull recomputes; it never takes the engine down
            logger.warning(
                "request %s: pulling its KV from %s:%s failed (%s); its prompt is computed here",
                load.request_id, load.remote_host, load.remote_port, exc,
            )
        self._finish_recv(load.request_id, ok)

    def _pull_blocks(self, load: RemoteLoad) -> None:
        import torch

        with socket.create_connection((load.remote_host, load.remote_port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(IO_TIMEOUT_S)
            kv_wire.send_message(sock, self._hello())
            reply = kv_wire.recv_message(sock, kv_wire.HelloReply)
            if not reply.ok:
                raise kv_wire.KVWireError(f"the prefill engine refused: {reply.error}")
            remote, transport = self._mapped_caches(reply), "cuda_ipc"
            if remote is None:
                remote, transport = self._mapped_segment(reply), "shm"
            if remote is None:
                transport = "tcp"
            kv_wire.send_message(sock, kv_wire.Pull(load.remote_request_id, load.remote_block_ids, transport))
            pulled = kv_wire.recv_message(sock, kv_wire.PullReply)
            if not pulled.ok:
                raise kv_wire.KVWireError(f"the prefill engine refused the pull: {pulled.error}")
            if remote is not None:
                self._copy_from_remote(remote, load)
                kv_wire.send_message(sock, kv_wire.PullDone(load.remote_request_id))
                return
            first = self.kv_caches[0]
            _, _, block_size, num_kv_heads, head_dim = first.shape
            num_blocks = len(load.block_ids)
            shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
            frame_bytes = 2 * num_blocks * block_size * num_kv_heads * head_dim * first.element_size()
            if pulled.num_frames != len(self.kv_caches) or pulled.frame_bytes != frame_bytes:
                raise kv_wire.KVWireError(f"the prefill engine announced {pulled.num_frames} frames of {pulled.frame_bytes} bytes")
            index = torch.tensor(load.block_ids, dtype=torch.int64, device=first.device)
            buffer = torch.empty(shape, dtype=first.dtype, pin_memory=first.device.type == "cuda")
            raw = memoryview(buffer.view(-1).view(torch.uint8).numpy())
            for kv in self.kv_caches:
                kv_wire.recv_frame_into(sock, raw)
                kv.index_copy_(1, index, buffer.to(kv.device))
            if first.device.type == "cuda":
                torch.cuda.current_stream(first.device).synchronize()

    def _mapped_caches(self, reply: kv_wire.HelloReply) -> list[torch.Tensor] | None:
        """The prefill engine's caches mapped here, when it offered them (same GPU) and they
        map (once per engine; a failure falls back to frames for good)."""
        if not self.same_host_transports or not reply.cuda_ipc or not self.kv_caches or self.kv_caches[0].device.type != "cuda":
            return None
        if reply.engine_id not in self._ipc_imports:
            mapped = None
            try:
                device = self.kv_caches[0].device
                mapped = cuda_ipc.import_kv_caches(reply.cuda_ipc, self.kv_caches, device.index or 0)
                logger.info("KV from engine %s: its cache is on this GPU, blocks are copied device to device", reply.engine_id)
            except Exception as exc:  # a driver that refuses: frames over the socket instead
                logger.warning("KV from engine %s: its CUDA IPC handles did not map (%s); blocks come over TCP", reply.engine_id, exc)
            with self._lock:
                self._ipc_imports[reply.engine_id] = mapped
        return self._ipc_imports[reply.engine_id]

    def _mapped_segment(self, reply: kv_wire.HelloReply) -> list[torch.Tensor] | None:
        """The prefill engine's shared-memory cache mapped here, when it offered one (same
        host, both on the CPU) and it maps (once per engine)."""
        if not self.same_host_transports or reply.shm is None or not self.kv_caches or self.kv_caches[0].device.type != "cpu":
            return None
        if reply.engine_id not in self._shm_maps:
            mapped = None
            try:
                mapped = host_shm.map_kv_caches(reply.shm.name, reply.shm.layer_bytes, reply.shm.num_blocks, self.kv_caches)
                logger.info("KV from engine %s: its cache is in this host's shared memory", reply.engine_id)
            except (OSError, ValueError) as exc:  # nothing shared: frames over the socket instead
                logger.warning("KV from engine %s: its shared-memory cache did not map (%s); blocks come over TCP", reply.engine_id, exc)
            with self._lock:
                self._shm_maps[reply.engine_id] = mapped
        mapped = self._shm_maps[reply.engine_id]
        return None if mapped is None else mapped[0]

    def _copy_from_remote(self, remote: list[torch.Tensor], load: RemoteLoad) -> None:
        """Gather the request's blocks from the other engine's caches (mapped here: shared
        memory, CUDA IPC) into this one's; on a GPU on a side stream that first waits for the
        work queued so far, and wait for it."""
        import torch

        if len(load.remote_block_ids) != len(load.block_ids):
            raise kv_wire.KVWireError(f"{len(load.remote_block_ids)} remote blocks for {len(load.block_ids)} local ones")
        if any(b >= remote[0].shape[1] for b in load.remote_block_ids):
            raise kv_wire.KVWireError(f"a remote block id beyond the prefill engine's {remote[0].shape[1]} blocks")
        device = self.kv_caches[0].device

        def gather() -> None:
            source = torch.tensor(load.remote_block_ids, dtype=torch.int64).to(device)
            dest = torch.tensor(load.block_ids, dtype=torch.int64).to(device)
            for kv, theirs in zip(self.kv_caches, remote):
                kv.index_copy_(1, dest, theirs.index_select(1, source))

        if device.type != "cuda":
            gather()
            return
        if self._pull_stream is None:
            self._pull_stream = torch.cuda.Stream(device)
        stream = self._pull_stream
        with torch.cuda.device(device), self._pull_lock:  # one pull at a time on the side stream
            stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                gather()
            stream.synchronize()

    def _finish_recv(self, req_id: str, ok: bool) -> None:
        with self._lock:
            self._done_recving.add(req_id)
            if not ok:
                self._failed.add(req_id)

    # -- prefill side: serving -------------------------------------------------------------

    def _serve(self) -> None:
        listener = self._listener
        while not self._closed:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, peer), name="sonar-kv-send", daemon=True).start()

    def _handle(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                self._serve_connection(conn)
            except Exception as exc:  # malformed input or a peer gone: this connection ends, the port lives on
                logger.warning("KV port: connection from %s closed: %s", peer, exc)

    def _serve_connection(self, conn: socket.socket) -> None:
        import torch

        hello = kv_wire.recv_message(conn, kv_wire.Hello)
        mismatches = self._layout_mismatches(hello)
        if mismatches:
            error = "KV layouts differ (prefill vs decode): " + "; ".join(mismatches)
            kv_wire.send_message(conn, kv_wire.HelloReply(False, self.engine_id, error))
            logger.warning("KV port: refused engine %s: %s", hello.engine_id, error)
            return
        handles = self._ipc_handles() if self._offers_ipc(hello) else []
        shm = None
        if self._offers_shm(hello):
            shm = kv_wire.SharedKVSegment(self._shared.socket_name, self._shared.layer_bytes, self._shared.num_blocks)
        kv_wire.send_message(conn, kv_wire.HelloReply(True, self.engine_id, cuda_ipc=handles, shm=shm))
        pull = kv_wire.recv_message(conn, kv_wire.Pull)
        served = self._wait_registered(pull.request_id)
        if served is None:
            kv_wire.send_message(conn, kv_wire.PullReply(False, error=f"no finished prefill {pull.request_id!r} holds blocks here"))
            return
        if not pull.block_ids or not set(pull.block_ids) <= served.block_ids:
            kv_wire.send_message(conn, kv_wire.PullReply(False, error=f"request {pull.request_id!r} does not hold those blocks"))
            return
        try:
            if pull.transport in ("cuda_ipc", "shm"):
                offered = self._offers_ipc(hello) if pull.transport == "cuda_ipc" else self._offers_shm(hello)
                if not offered:
                    kv_wire.send_message(conn, kv_wire.PullReply(False, error=f"this engine offers no {pull.transport} transport to the puller"))
                    return
                kv_wire.send_message(conn, kv_wire.PullReply(True))
                done = kv_wire.recv_message(conn, kv_wire.PullDone)  # the blocks stay until the copy is done
                if done.request_id != pull.request_id:
                    raise kv_wire.KVWireError(f"pull_done for {done.request_id!r}, not {pull.request_id!r}")
                return
            if pull.transport != "tcp":
                kv_wire.send_message(conn, kv_wire.PullReply(False, error=f"unknown transport {pull.transport!r}"))
                return
            first = self.kv_caches[0]
            index = torch.tensor(pull.block_ids, dtype=torch.int64, device=first.device)
            frame_bytes = len(pull.block_ids) * self.layout.bytes_per_block // self.layout.num_layers
            kv_wire.send_message(conn, kv_wire.PullReply(True, len(self.kv_caches), frame_bytes))
            for kv in self.kv_caches:
                blocks = kv.index_select(1, index).cpu().contiguous()  # [2, n, block_size, heads, head_dim]
                kv_wire.send_frame(conn, memoryview(blocks.view(-1).view(torch.uint8).numpy()))
        finally:  # pulled, or the decode engine went away mid-transfer: either way the blocks go
            with self._lock:
                if self._served.pop(pull.request_id, None) is not None:
                    self._done_sending.add(pull.request_id)

    def _offers_ipc(self, hello: kv_wire.Hello) -> bool:
        """Whether the puller's cache is on this engine's GPU, on this host."""
        if not self.same_host_transports or not self.kv_caches or self.kv_caches[0].device.type != "cuda":
            return False
        return bool(hello.device_uuid) and hello.host_id == self._host_id and hello.device_uuid == cuda_ipc.device_uuid(self.kv_caches[0].device)

    def _offers_shm(self, hello: kv_wire.Hello) -> bool:
        """Whether the puller is on this host, with its cache (like this one's) in host memory."""
        return self._shared is not None and not hello.device_uuid and hello.host_id == self._host_id

    def _ipc_handles(self) -> list[kv_wire.CudaIpcHandle]:
        """This engine's caches as CUDA IPC handles, made once ([] where they cannot be)."""
        with self._lock:
            if self._ipc_exports is None:
                try:
                    self._ipc_exports = cuda_ipc.export_kv_caches(self.kv_caches)
                except Exception as exc:
                    logger.warning("KV port: the KV cache cannot be shared through CUDA IPC (%s); blocks go over TCP", exc)
                    self._ipc_exports = []
            return self._ipc_exports

    def _layout_mismatches(self, hello: kv_wire.Hello) -> list[str]:
        if hello.version != kv_wire.PROTOCOL_VERSION:
            return [f"protocol version {kv_wire.PROTOCOL_VERSION} != {hello.version}"]
        theirs = KVCacheLayout(
            hello.model, hello.dtype, hello.block_size, hello.num_layers, hello.num_kv_heads, hello.head_dim, 0,
            hello.tensor_parallel_size,
        )
        return self.layout.mismatches(theirs)

    def _wait_registered(self, req_id: str) -> _Served | None:
        deadline = time.monotonic() + REGISTRATION_WAIT_S
        with self._lock:
            while req_id not in self._served and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)
            return self._served.get(req_id)
