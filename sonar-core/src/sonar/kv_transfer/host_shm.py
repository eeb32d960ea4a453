"""KV blocks between two CPU engines on one host without copying them through a socket:
the prefill engine's cache lives in an anonymous shared-memory file that the decode engine maps.

A prefill engine on the CPU moves its KV cache into a ``memfd`` when its connector registers
the cache (:class:`SharedKVCache`). It has no name in any file system, so nothing is left
behind however the engine ends: the memory goes when the last process holding it exits. A
decode engine on the same host asks for it over a Unix socket in the abstract namespace (named
in the KV port's ``HelloReply``), receives a read-only descriptor of it (``SCM_RIGHTS``; only
processes of the same user are answered), maps it read-only (:func:`map_kv_caches`) and copies
a request's blocks straight out of it.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
RECV_TIMEOUT_S = 5.0


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "AF_UNIX")


class SharedKVCache:
    """A prefill engine's KV cache held in one ``memfd``, every layer's ``[2, num_blocks, ...]``
    tensor one after the other, handed read-only to same-user processes on this host that ask
    on the Unix socket ``socket_name``."""

    def __init__(self, kv_caches: list[torch.Tensor], engine_id: str) -> None:
        import torch

        first = kv_caches[0]
        self.layer_bytes = first.numel() * first.element_size()
        self.num_blocks = first.shape[1]
        total = self.layer_bytes * len(kv_caches)
        self._fd = os.memfd_create("sonar-kv-cache", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, total)
        self._map = mmap.mmap(self._fd, total)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        for index, kv in enumerate(kv_caches):
            part = whole[index * self.layer_bytes : (index + 1) * self.layer_bytes].view(kv.dtype).view(kv.shape)
            part.copy_(kv)
            kv.set_(part.untyped_storage(), part.storage_offset(), kv.shape)
        self.socket_name = f"sonar-kv-{engine_id}-{os.getpid()}-{os.urandom(4).hex()}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.socket_name)
        self._listener.listen(16)
        self._closed = False
        threading.Thread(target=self._serve, name="sonar-kv-shm", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                try:
                    _, uid, _ = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
                    if uid != os.getuid():
                        logger.warning("KV cache: refused a process of user %d asking for the shared cache", uid)
                        continue
                    readonly = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        socket.send_fds(conn, [b"kv"], [readonly])
                    finally:
                        os.close(readonly)
                except OSError as exc:
                    logger.warning("KV cache: handing the shared cache over failed: %s", exc)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def share_kv_caches(kv_caches: list[torch.Tensor], engine_id: str) -> SharedKVCache | None:
    """Move ``kv_caches`` (CPU, contiguous, all one shape) into shared memory, in place (the
    tensors keep their identity and contents); None where this platform cannot."""
    if not supported() or not kv_caches or any(kv.device.type != "cpu" or not kv.is_contiguous() for kv in kv_caches):
        return None
    return SharedKVCache(kv_caches, "".join(c for c in engine_id if c.isalnum())[:32])


def map_kv_caches(socket_name: str, layer_bytes: int, num_blocks: int, like: list[torch.Tensor]) -> tuple[list[torch.Tensor], mmap.mmap]:
    """Another engine's shared KV cache mapped here read-only: one tensor per layer shaped as
    ``like`` (this engine's caches) with the other's ``num_blocks``, and the mapping (kept as
    long as the tensors are used).

    :raises ValueError: the sizes disagree with the layout or the memory received.
    :raises OSError: nobody answered on ``socket_name``, or without a descriptor.
    """
    import torch

    if not supported():
        raise OSError("no memfd or SCM_RIGHTS on this platform")
    if not socket_name.startswith("sonar-kv-") or len(socket_name) > 100 or "\0" in socket_name:
        raise ValueError(f"{socket_name!r} is not a Sonar KV-cache socket")
    shape = (like[0].shape[0], num_blocks, *like[0].shape[2:])
    expected = torch.Size(shape).numel() * like[0].element_size()
    if num_blocks < 1 or layer_bytes != expected:
        raise ValueError(f"a shared layer of {layer_bytes} bytes where {num_blocks} blocks take {expected}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(RECV_TIMEOUT_S)
        sock.connect("\0" + socket_name)
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError("the prefill engine sent no descriptor of its KV cache")
    fd = fds[0]
    try:
        size = os.fstat(fd).st_size
        if size < layer_bytes * len(like):
            raise ValueError(f"the shared KV cache holds {size} bytes, {layer_bytes * len(like)} expected")
        mapping = mmap.mmap(fd, layer_bytes * len(like), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory: these views are only read
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = [whole[i * layer_bytes : (i + 1) * layer_bytes].view(like[0].dtype).view(shape) for i in range(len(like))]
    return tensors, mapping
