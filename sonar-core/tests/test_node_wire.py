"""The multi-node control link's frames: what a peer sends is checked for size, message kind
and field types before anything acts on it; a follower's options are compared field by field
with the head's, less what may differ per host."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from pathlib import Path

import msgspec
import pytest

from sonar.config import EngineConfig
from sonar.executor.multinode import NodeLayout, _refusal
from sonar.executor.node_wire import (
    MAX_FRAME_BYTES, PROTOCOL_VERSION, Broadcast, Hello, LinkError, Reply, comparable_config, config_differences,
    model_fingerprint, receive_message, send_message,
)

CONFIG = EngineConfig(
    model="/models/a", served_name="a", load_format="safetensors", tokenizer=None, skip_tokenizer_init=False, dtype="float32",
    max_model_len=512, vocab_size=100, eos_token_ids=(2,), max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
    enable_prefix_caching=True, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, async_scheduling=False,
    max_logprobs=20, seed=0, data_parallel_size=1, platform="cpu", tensor_parallel_size=2, executor="mp", nnodes=2,
)


@pytest.fixture
def pair():
    head, follower = socket.socketpair()
    yield head, follower
    head.close()
    follower.close()


def test_messages_cross_unchanged(pair) -> None:
    head, follower = pair
    send_message(head, Broadcast(b"\x93\x01\x02\x03"))
    send_message(follower, Reply(rank=1, data=b"ok"))
    assert receive_message(follower) == Broadcast(b"\x93\x01\x02\x03")
    assert receive_message(head) == Reply(rank=1, data=b"ok")


def test_an_oversized_frame_is_refused_before_it_is_read(pair) -> None:
    head, follower = pair
    head.sendall(struct.pack("!I", MAX_FRAME_BYTES + 1))
    with pytest.raises(LinkError, match="not a Sonar control link"):
        receive_message(follower)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"type": "launch_missiles"}),  # no such message
        msgspec.msgpack.encode({"type": "reply", "rank": "one", "data": b""}),  # a field of the wrong type
        msgspec.msgpack.encode({"type": "broadcast", "data": b"", "extra": 1}),  # an unknown field
    ],
)
def test_an_invalid_message_is_refused(pair, body: bytes) -> None:
    head, follower = pair
    head.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(LinkError, match="invalid control message"):
        receive_message(follower)


def test_a_closed_link_is_a_link_error(pair) -> None:
    head, follower = pair
    head.sendall(struct.pack("!I", 10) + b"abc")  # cut short
    head.close()
    with pytest.raises(LinkError, match="closed"):
        receive_message(follower)


def test_per_host_options_may_differ_and_the_rest_may_not() -> None:
    head = comparable_config(CONFIG)
    elsewhere = dataclasses.replace(CONFIG, model="/data/a", served_name="other", node_rank=1, master_addr="head.local")
    assert config_differences(head, comparable_config(elsewhere)) == []
    other = dataclasses.replace(CONFIG, max_num_seqs=8, dtype="bfloat16")
    assert config_differences(head, comparable_config(other)) == [
        "dtype: head 'float32', follower 'bfloat16'", "max_num_seqs: head 256, follower 8",
    ]


def test_the_head_names_why_it_refuses(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    head = dataclasses.replace(CONFIG, model=str(tmp_path))
    expected, fingerprint = comparable_config(head), model_fingerprint(str(tmp_path))

    def hello(**changes) -> Hello:
        fields = {"protocol": PROTOCOL_VERSION, "node_rank": 1, "host": "b", "config": expected, "model_fingerprint": fingerprint}
        return Hello(**{**fields, **changes})

    assert _refusal(hello(), head, expected, fingerprint, {}) is None
    assert "control protocol 0" in _refusal(hello(protocol=0), head, expected, fingerprint, {})
    assert "not a follower of nnodes=2" in _refusal(hello(node_rank=2), head, expected, fingerprint, {})
    assert "already joined" in _refusal(hello(), head, expected, fingerprint, {1: _Joined()})
    other_model = tmp_path / "other"
    other_model.mkdir()
    (other_model / "config.json").write_text(json.dumps({"hidden_size": 16}))
    assert "model files differ" in _refusal(hello(model_fingerprint=model_fingerprint(str(other_model))), head, expected, fingerprint, {})


class _Joined:
    host = "a"


def test_ranks_split_evenly_and_consecutively() -> None:
    assert [NodeLayout(4, 2, node).ranks for node in (0, 1)] == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="evenly"):
        NodeLayout(3, 2, 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _handshake(tmp_path: Path, monkeypatch, head_secret: bytes | None, follower_secret: bytes | None, **follower_changes):
    """A real head (``accept_followers``, in a thread) and a real follower (``_join_head``) on
    loopback, each with its own secret: ``(what the head returned or raised, what the follower did)``."""
    import threading

    from sonar.executor import multinode, node_follower

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    head = dataclasses.replace(CONFIG, model=str(tmp_path), master_addr="127.0.0.1", master_port=_free_port() - 1)
    follower = dataclasses.replace(head, node_rank=1, **follower_changes)
    monkeypatch.setenv("SONAR_WORKER_STARTUP_TIMEOUT_S", "2")
    monkeypatch.setattr(multinode, "node_secret", lambda: head_secret)
    monkeypatch.setattr(node_follower, "node_secret", lambda: follower_secret)
    head_result: list = []

    def run_head() -> None:
        try:
            head_result.append(multinode.accept_followers(head, 4))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            head_result.append(exc)

    thread = threading.Thread(target=run_head)
    thread.start()
    try:
        follower_result = node_follower._join_head(follower)
    except Exception as exc:  # noqa: BLE001
        follower_result = exc
    thread.join(10)
    for value in (head_result[0], follower_result):
        for sock in value if isinstance(value, list) else [value]:
            getattr(getattr(sock, "sock", sock), "close", lambda: None)()
    return head_result[0], follower_result


def test_a_shared_secret_admits_the_follower(tmp_path: Path, monkeypatch) -> None:
    joined, follower = _handshake(tmp_path, monkeypatch, b"s3cret", b"s3cret")
    assert isinstance(follower, socket.socket) and [link.layout.node_rank for link in joined] == [1]


@pytest.mark.parametrize(
    ("head_secret", "follower_secret", "follower_error"),
    [
        (b"s3cret", None, "did not prove the head's SONAR_NODE_SECRET"),  # an outsider learns nothing else
        (b"s3cret", b"other", "did not prove the head's SONAR_NODE_SECRET"),
        (None, b"s3cret", "does not authenticate its followers"),  # a follower never runs for an unproven head
    ],
)
def test_a_follower_without_the_secret_is_refused(tmp_path: Path, monkeypatch, head_secret, follower_secret, follower_error) -> None:
    from sonar.executor.base import WorkerDiedError

    head, follower = _handshake(tmp_path, monkeypatch, head_secret, follower_secret, max_num_seqs=8)
    assert isinstance(follower, ValueError) and follower_error in str(follower)
    assert "max_num_seqs" not in str(follower)  # the options (which differ) are not compared before the proof
    assert isinstance(head, WorkerDiedError) and "did not join" in str(head)


def test_a_greeting_frame_is_bounded(pair) -> None:
    from sonar.executor.node_wire import MAX_GREETING_BYTES

    head, follower = pair
    follower.sendall(struct.pack("!I", MAX_GREETING_BYTES + 1))
    with pytest.raises(LinkError, match="at most"):
        receive_message(head, MAX_GREETING_BYTES)
