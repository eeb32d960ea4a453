"""The shared-memory ring the tensor-parallel executor broadcasts steps through."""

from __future__ import annotations

import pytest

from sonar.executor.shm_broadcast import RingReader, RingTimeout, RingWriter


def test_every_reader_gets_every_message_in_order_across_wraparound() -> None:
    writer = RingWriter(num_readers=2, num_slots=3, slot_bytes=64)
    readers = [RingReader(writer.name, i, 2, 3, 64) for i in range(2)]
    try:
        messages = [bytes([i]) * (i % 64 + 1) for i in range(10)]
        for message in messages:
            assert writer.write(message, timeout_s=1.0)
            assert [r.read(timeout_s=1.0) for r in readers] == [message, message]
        assert not writer.write(b"x" * 65, timeout_s=1.0)  # larger than a slot: the caller's to send
    finally:
        for reader in readers:
            reader.close()
        writer.unlink()


def test_a_full_ring_and_an_empty_one_time_out_instead_of_hanging() -> None:
    writer = RingWriter(num_readers=2, num_slots=2, slot_bytes=16)
    fast, slow = RingReader(writer.name, 0, 2, 2, 16), RingReader(writer.name, 1, 2, 2, 16)
    try:
        assert writer.write(b"a", 1.0) and writer.write(b"b", 1.0)
        assert fast.read(1.0) == b"a" and fast.read(1.0) == b"b"
        with pytest.raises(RingTimeout, match="a reader did not read its slot"):
            writer.write(b"c", timeout_s=0.05)  # slot 0 still waits on the slow reader
        with pytest.raises(RingTimeout, match="the peer is gone"):
            writer.write(b"c", timeout_s=5.0, alive=lambda: False)
        assert slow.read(1.0) == b"a"
        assert writer.write(b"c", 1.0)
        assert fast.read(1.0) == b"c"
        with pytest.raises(RingTimeout, match="no message came"):
            fast.read(timeout_s=0.05)
    finally:
        fast.close()
        slow.close()
        writer.unlink()
