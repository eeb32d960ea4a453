"""Every message that crosses the control link between the head's executor and a follower host.

One TCP connection per follower carries length-prefixed msgpack frames (plain data, never
pickled): ``[num_bytes: uint32, big-endian][msgpack of one message below]``. A frame larger
than ``MAX_FRAME_BYTES``, or one that is not a known message with fields of the right types,
is refused and closes the link; until a follower is accepted, no frame may exceed
``MAX_GREETING_BYTES``.

With ``SONAR_NODE_SECRET`` set (the same value on every host), each side proves it knows the
secret by an HMAC-SHA256 of the other side's fresh nonce: the head accepts only followers that
prove it (before it compares their options, so an outsider learns nothing of the configuration),
and a follower runs only for a head that proves it. Without the secret anyone who reaches the
control port during start-up may join: use a trusted network.

    head -> follower   Challenge  a fresh nonce, and whether the head authenticates its followers
    follower -> head   Hello      who it is and what it runs (checked against the head's), with its
                                  proof of the shared secret where there is one
    head -> follower   Verdict    accepted, or refused with the reason (and the head's own proof)
    head -> follower   Start      every host is in: start the ranks (they join the rendezvous)
    head -> follower   Broadcast  one executor message for every rank of the follower
    follower -> head   Reply      one rank's reply, as the rank encoded it
    follower -> head   RankExited a rank of the follower died: the link closes after it
    head -> follower   Shutdown   the head's executor shut down: stop the ranks and exit
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgspec

PROTOCOL_VERSION = 2
FRAME_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a step message is far smaller; anything larger is a broken peer
MAX_GREETING_BYTES = 1 << 20  # a Challenge, Hello or Verdict: before a peer is trusted
SECRET_ENV = "SONAR_NODE_SECRET"
NONCE_BYTES = 16
# engine options that may differ between hosts: where the model lies, what only the head's
# frontend uses, and the host's own place
PER_HOST_FIELDS = frozenset({
    "model", "served_name", "tokenizer", "skip_tokenizer_init", "default_sampling", "node_rank", "master_addr",
})


class Challenge(msgspec.Struct, tag="challenge", forbid_unknown_fields=True):
    """The head's first frame on a new connection."""

    protocol: int
    nonce: bytes  # the follower proves the secret over it
    authenticated: bool  # whether the head has a SONAR_NODE_SECRET


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """A follower's introduction: its node rank and what it would run."""

    protocol: int
    node_rank: int
    host: str
    config: dict[str, Any]  # the follower's engine configuration, less PER_HOST_FIELDS
    model_fingerprint: str  # model_fingerprint() of its model files
    nonce: bytes = b""  # the head proves the secret over it
    proof: bytes = b""  # prove(secret, the Challenge's nonce, FOLLOWER) where the follower has a secret


class Verdict(msgspec.Struct, tag="verdict", forbid_unknown_fields=True):
    """The head's answer to a ``Hello``."""

    accepted: bool
    reason: str = ""
    proof: bytes = b""  # prove(secret, the Hello's nonce, HEAD) where the head has a secret


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """Every follower is in: start the ranks now."""


class Broadcast(msgspec.Struct, tag="broadcast", forbid_unknown_fields=True):
    """One message of the executor's to every rank (an encoded ``WorkerCall``)."""

    data: bytes


class Reply(msgspec.Struct, tag="reply", forbid_unknown_fields=True):
    """Rank ``rank``'s reply (an encoded ``WorkerReply``), forwarded unchanged."""

    rank: int
    data: bytes


class RankExited(msgspec.Struct, tag="rank_exited", forbid_unknown_fields=True):
    """Rank ``rank`` of the follower exited with ``exit_code`` (None: unknown)."""

    rank: int
    exit_code: int | None = None


class Shutdown(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    """The head's executor shut down (the engine stopped): the follower ends too."""


Message = Challenge | Hello | Verdict | Start | Broadcast | Reply | RankExited | Shutdown


class LinkError(ConnectionError):
    """The control link closed, or its peer sent something that is not a valid frame."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def send_message(sock: socket.socket, message: Message) -> None:
    """Write one frame; raises LinkError where the peer is gone."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a {type(message).__name__} of {len(body)} bytes exceeds the control link's {MAX_FRAME_BYTES} bytes")
    try:
        sock.sendall(FRAME_HEADER.pack(len(body)) + body)
    except OSError as exc:
        raise LinkError(f"the control link closed while sending ({exc})") from None


def receive_message(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Read one frame of at most ``max_bytes`` and check it is a known message with fields of
    the right types."""
    (num_bytes,) = FRAME_HEADER.unpack(_receive_exactly(sock, FRAME_HEADER.size))
    if num_bytes > max_bytes:
        raise LinkError(f"the peer announced a frame of {num_bytes} bytes (at most {max_bytes}): not a Sonar control link")
    try:
        return _decoder.decode(_receive_exactly(sock, num_bytes))
    except msgspec.DecodeError as exc:  # ValidationError included: a wrong type or an unknown message
        raise LinkError(f"the peer sent an invalid control message ({exc})") from None


FOLLOWER, HEAD = b"sonar-node-follower:", b"sonar-node-head:"


def node_secret() -> bytes | None:
    """The shared secret of ``SONAR_NODE_SECRET`` (None where it is unset or empty)."""
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    """The proof that the side ``role`` (FOLLOWER or HEAD) knows ``secret``, over the other
    side's fresh ``nonce``."""
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def proves(secret: bytes, nonce: bytes, role: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is ``prove(secret, nonce, role)`` (in constant time)."""
    return len(nonce) == NONCE_BYTES and hmac.compare_digest(prove(secret, nonce, role), proof)


def _receive_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, remaining = [], num_bytes
    while remaining:
        try:
            chunk = sock.recv(min(remaining, 1 << 20))
        except OSError as exc:
            raise LinkError(f"the control link closed ({exc})") from None
        if not chunk:
            raise LinkError("the control link closed (the peer is gone)")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def keep_alive(sock: socket.socket, timeout_s: int = 30) -> None:
    """Notice a peer host that vanished without closing (power loss, a cut cable) within
    about ``timeout_s`` seconds: TCP keepalive probes while idle, and a bound on unacknowledged
    data while sending. No-delay too: step messages are small and latency-bound."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", timeout_s // 3), ("TCP_KEEPINTVL", max(1, timeout_s // 9)), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_s * 1000)


def comparable_config(config: Any) -> dict[str, Any]:
    """An ``EngineConfig`` as plain data, less what may differ between hosts."""
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(config))  # as it arrives from a peer (tuples as lists)
    return {key: value for key, value in plain.items() if key not in PER_HOST_FIELDS}


def config_differences(head: dict[str, Any], follower: dict[str, Any]) -> list[str]:
    """``name: head X, follower Y`` for each option the two hosts set differently."""
    return [
        f"{key}: head {head.get(key)!r}, follower {follower.get(key)!r}"
        for key in sorted(set(head) | set(follower))
        if head.get(key) != follower.get(key)
    ]


def model_fingerprint(model: str) -> str:
    """A digest of a model that is cheap to take on every host: its config.json and the names
    and sizes of its weight files (a folder), or its size and first MiB (a single file)."""
    path = Path(model)
    digest = hashlib.sha256()
    if path.is_dir():
        config = path / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"")
        for file in sorted(path.iterdir()):
            if file.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
                digest.update(f"{file.name}:{file.stat().st_size};".encode())
    else:
        digest.update(str(path.stat().st_size).encode())
        with path.open("rb") as handle:
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]
