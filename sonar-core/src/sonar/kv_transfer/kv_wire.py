"""The KV port's wire format: what two engines exchanging KV blocks say to each other over TCP.

Every message is a header, then the raw tensor frames the header announces, nothing else:

    header:  u32 little-endian length, then a msgspec-msgpack ``KVMessage`` (a tagged union)
    frame:   u64 little-endian length, then that many bytes (one layer's blocks, C order)

A receiver decodes a header into the one union it expects (a typed decoder: nothing from the
socket is ever unpickled or evaluated), refuses a header longer than ``MAX_HEADER_BYTES`` and
a frame whose length is not the one it computed from the agreed layout, and closes the
connection on anything else.

A pull, decode side first:  ``Hello`` -> ``HelloReply`` (the prefill side refuses a layout that
differs from its own, naming what differs), then ``Pull`` -> ``PullReply`` and, when it is ok,
one frame per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the cache's
dtype.

Two engines on one GPU (the same host and device, as their ``Hello`` and the prefill side's
own identity say) skip the frames: the prefill side's ``HelloReply`` carries CUDA IPC handles
of its KV-cache tensors, the decode side maps them once per prefill engine, asks with
``Pull(transport="cuda_ipc")``, copies the blocks device to device itself and says
``PullDone``; the prefill side frees the blocks only then (or when the connection ends).
Handles are plain bytes and integers, opened by the CUDA driver, never unpickled. Two CPU
engines on one host do the same through shared memory (``HelloReply.shm``: where to ask for a
read-only descriptor of it; pulled with ``transport="shm"``).
"""

from __future__ import annotations

import socket
import struct
from typing import Union

import msgspec

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 64 * 1024
_HEADER_LEN = struct.Struct("<I")
_FRAME_LEN = struct.Struct("<Q")


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """The decode side's layout, first thing on a connection."""

    version: int
    engine_id: str
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int
    host_id: str = ""  # the machine (host name and boot id): equal on one host
    device_uuid: str = ""  # the GPU the decode side's cache is on ("": not a GPU)


class CudaIpcHandle(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One layer's KV-cache tensor as CUDA IPC shares it: the allocation holding its storage
    and where in it the ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor lies."""

    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int  # in elements, within the storage
    num_blocks: int


class SharedKVSegment(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A CPU engine's KV cache in shared memory, handed out on the Unix socket ``name`` (abstract
    namespace): every layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor,
    ``layer_bytes`` each."""

    name: str
    layer_bytes: int
    num_blocks: int


class HelloReply(msgspec.Struct, tag="hello_reply", forbid_unknown_fields=True):
    ok: bool
    engine_id: str
    error: str = ""
    cuda_ipc: list[CudaIpcHandle] = []  # one per layer, when both caches are on one GPU
    shm: SharedKVSegment | None = None  # when both caches are in one host's memory


class Pull(msgspec.Struct, tag="pull", forbid_unknown_fields=True):
    """Send these blocks of the finished prefill ``request_id`` (a subset of those it named)."""

    request_id: str
    block_ids: list[int]
    transport: str = "tcp"  # "tcp": frames follow the reply; "cuda_ipc", "shm": the decode side copies


class PullDone(msgspec.Struct, tag="pull_done", forbid_unknown_fields=True):
    """The decode side copied the blocks of a ``cuda_ipc`` pull: they may be freed."""

    request_id: str


class PullReply(msgspec.Struct, tag="pull_reply", forbid_unknown_fields=True):
    ok: bool
    num_frames: int = 0
    frame_bytes: int = 0  # each frame's length
    error: str = ""


KVMessage = Union[Hello, HelloReply, Pull, PullReply, PullDone]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVMessage)


class KVWireError(ConnectionError):
    """The peer sent something this format does not allow, or went away mid-message."""


def send_message(sock: socket.socket, message: KVMessage) -> None:
    payload = _ENCODER.encode(message)
    sock.sendall(_HEADER_LEN.pack(len(payload)) + payload)


def recv_message(sock: socket.socket, expected: type) -> KVMessage:
    """The next header, which must decode into ``expected``."""
    (length,) = _HEADER_LEN.unpack(_recv_exactly(sock, _HEADER_LEN.size))
    if not 0 < length <= MAX_HEADER_BYTES:
        raise KVWireError(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    try:
        message = _DECODER.decode(_recv_exactly(sock, length))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVWireError(f"a header that is not a KV message: {exc}") from None
    if not isinstance(message, expected):
        raise KVWireError(f"expected {expected.__name__}, got {type(message).__name__}")
    return message


def send_frame(sock: socket.socket, data: memoryview) -> None:
    sock.sendall(_FRAME_LEN.pack(data.nbytes))
    sock.sendall(data)


def recv_frame_into(sock: socket.socket, buffer: memoryview) -> None:
    """The next frame, into ``buffer``, whose length it must have exactly."""
    (length,) = _FRAME_LEN.unpack(_recv_exactly(sock, _FRAME_LEN.size))
    if length != buffer.nbytes:
        raise KVWireError(f"a frame of {length} bytes where {buffer.nbytes} were agreed")
    view = buffer.cast("B")
    received = 0
    while received < length:
        count = sock.recv_into(view[received:], length - received)
        if count == 0:
            raise KVWireError("the peer closed the connection mid-frame")
        received += count


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, remaining = [], count
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise KVWireError("the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
