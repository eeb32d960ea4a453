"""The ``NixlConnector``'s side channel: how a decode engine learns where a prefill engine's KV
cache is before it reads blocks from it over NIXL.

One short TCP connection per pull, decode side first, each message a header as in
``sonar.kv_transfer.kv_wire`` (u32 little-endian length, then a msgspec-msgpack struct of a
tagged union; never pickle):

    decode -> prefill   ``NixlHello``: the decode engine's KV layout, the request it reads
    prefill -> decode   ``NixlHelloReply``: refused (a layout that differs, each difference
                        named; a request whose blocks were already freed), or the prefill
                        engine's NIXL agent metadata and its cache: one base address per
                        layer, its number of blocks, the bytes of one block of keys (or
                        values) of one layer, the memory kind and device, and how long the
                        request's blocks stay (the decode side gives up its read before then)

The blocks then move by NIXL alone: the decode engine READs them into its own blocks and its
transfer carries a notification, ``NixlFree``, on which the prefill engine frees them. A decode
engine that reads none of them (its own prefix cache holds the prompt, or the read failed)
sends ``NixlFree`` on a connection of its own instead, as its only message. A receiver decodes each message into the one type it expects,
refuses a header longer than ``MAX_HEADER_BYTES``, and closes the connection on anything else.

A built-in ``SonarConnector`` engine that connects to this port by mistake is answered with a
``kv_wire.HelloReply`` refusal naming the connector this port speaks.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from sonar.kv_transfer import kv_wire
from sonar.kv_transfer.kv_wire import KVWireError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # NIXL agent metadata is a few KB
_HEADER_LEN = struct.Struct("<I")


class NixlHello(msgspec.Struct, tag="nixl_hello", forbid_unknown_fields=True):
    """The decode side's KV layout, first thing on a connection."""

    version: int
    engine_id: str
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int
    request_id: str = ""  # the prefill request whose blocks it is about to read


class NixlHelloReply(msgspec.Struct, tag="nixl_hello_reply", forbid_unknown_fields=True):
    """The prefill side's answer: ``ok`` and where its cache is, or why not."""

    ok: bool
    engine_id: str
    error: str = ""
    agent_name: str = ""
    agent_metadata: bytes = b""  # nixl_agent.get_agent_metadata(): opened by NIXL, never unpickled
    mem_type: str = ""  # "DRAM" or "VRAM"
    device_id: int = 0
    layer_addresses: list[int] = []  # per layer: where its [2, num_blocks, block_size, heads, head_dim] tensor starts
    num_blocks: int = 0
    block_bytes: int = 0  # one block of keys (or of values) of one layer
    expires_in_s: float = 0.0  # until the prefill side frees the request's blocks unread


class NixlFree(msgspec.Struct, tag="nixl_free", forbid_unknown_fields=True):
    """The decode side is done with the blocks of prefill ``request_id`` (read, or given up
    on): the prefill side frees them. It comes as the notification of a read, or alone on a
    side-channel connection (then naming the engine it is meant for, ignored by any other)."""

    request_id: str
    engine_id: str = ""


SideChannelMessage = NixlHello | NixlHelloReply | NixlFree | kv_wire.Hello

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SideChannelMessage)
_NOTIF_DECODER = msgspec.msgpack.Decoder(NixlFree)


def send_message(sock: socket.socket, message: NixlHello | NixlHelloReply | NixlFree) -> None:
    payload = _ENCODER.encode(message)
    sock.sendall(_HEADER_LEN.pack(len(payload)) + payload)


def recv_message(sock: socket.socket, expected: type | tuple[type, ...]) -> SideChannelMessage:
    """The next header, which must decode into ``expected``.

    :raises KVWireError: the peer closed the connection, sent an oversized or malformed
        header, or another message.
    """
    (length,) = _HEADER_LEN.unpack(_recv_exactly(sock, _HEADER_LEN.size))
    if not 0 < length <= MAX_HEADER_BYTES:
        raise KVWireError(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    try:
        message = _DECODER.decode(_recv_exactly(sock, length))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVWireError(f"a header that is not a NIXL side-channel message: {exc}") from None
    if not isinstance(message, expected):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise KVWireError(f"expected {names}, got {type(message).__name__}")
    return message


def encode_free(request_id: str) -> bytes:
    return _ENCODER.encode(NixlFree(request_id))


def decode_free(notification: bytes) -> str | None:
    """The request a ``NixlFree`` notification names (None: not one)."""
    try:
        return _NOTIF_DECODER.decode(notification).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, remaining = [], count
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise KVWireError("the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
