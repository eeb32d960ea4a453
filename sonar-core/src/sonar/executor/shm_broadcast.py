"""A one-writer, many-reader ring of byte messages in shared memory, for one host.

The executor writes each step's message once; every worker rank reads it from the same
memory, instead of the executor copying it into one socket per rank. The ring has
``num_slots`` slots of ``slot_bytes``; each slot holds a header, then the message:

    [seq: int64][num_bytes: int64][one "read" byte per reader][message ...]

The writer fills a slot only once every reader has read what it held, writes the message,
then its length, clears the read bytes and publishes the sequence number last; a reader
waits for the sequence number it expects, copies the message and sets its read byte. Waiting
polls (a short spin, then sleeps up to ``MAX_SLEEP_S``, longer ones once idle) and gives up
after a timeout, so
neither side can hang on a peer that is gone. A message larger than a slot does not fit:
``write`` returns False and the caller sends it another way.
"""

from __future__ import annotations

import struct
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Callable

HEADER = struct.Struct("<qq")  # seq, num_bytes
SPIN_S = 0.0005  # busy-poll this long before sleeping
MAX_SLEEP_S = 0.001  # the longest sleep between polls while a message is due soon
IDLE_AFTER_S = 0.2  # waiting longer than this, the reader is idle: it sleeps up to IDLE_SLEEP_S
IDLE_SLEEP_S = 0.005  # (the first message after an idle spell waits at most this much more)
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release), so the message's bytes are
    visible before the sequence number that publishes them (and read after it)."""
    with _fence_lock:
        pass


class RingTimeout(TimeoutError):
    """The other side did not write (or read) within the timeout."""


class _Ring:
    def __init__(self, shm: shared_memory.SharedMemory, num_readers: int, num_slots: int, slot_bytes: int) -> None:
        self.shm = shm
        self.num_readers = num_readers
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.header_bytes = HEADER.size + num_readers
        self.stride = self.header_bytes + slot_bytes

    def _offset(self, seq: int) -> int:
        return (seq % self.num_slots) * self.stride

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], bool] | None) -> None:
        started = time.monotonic()
        sleep = 0.0
        while not ready():
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise RingTimeout(f"shared-memory ring: {what} for {timeout_s:.0f} s")
            if alive is not None and not alive():
                raise RingTimeout(f"shared-memory ring: gave up waiting for {what} (the peer is gone)")
            if elapsed > SPIN_S:
                sleep = min(MAX_SLEEP_S if elapsed < IDLE_AFTER_S else IDLE_SLEEP_S, sleep * 2 or 0.00005)
                time.sleep(sleep)
        _fence()

    def close(self) -> None:
        self.shm.close()


class RingWriter(_Ring):
    """The writing end: creates the shared memory (``name`` tells readers where it is)."""

    def __init__(self, num_readers: int, num_slots: int = 4, slot_bytes: int = 4 << 20) -> None:
        stride = HEADER.size + num_readers + slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=num_slots * stride)
        super().__init__(shm, num_readers, num_slots, slot_bytes)
        for slot in range(num_slots):  # every slot starts empty and "read by everyone"
            offset = slot * stride
            HEADER.pack_into(shm.buf, offset, -1, 0)
            shm.buf[offset + HEADER.size : offset + self.header_bytes] = b"\x01" * num_readers
        self.next_seq = 0

    @property
    def name(self) -> str:
        return self.shm.name

    def write(self, data: bytes, timeout_s: float, alive: Callable[[], bool] | None = None) -> bool:
        """Publish ``data`` to every reader; False (nothing written) where it exceeds a slot.

        :raises RingTimeout: a reader has not read the slot's last message within ``timeout_s``.
        """
        if len(data) > self.slot_bytes:
            return False
        buf, offset = self.shm.buf, self._offset(self.next_seq)
        acks = slice(offset + HEADER.size, offset + self.header_bytes)
        self._wait(lambda: all(buf[acks]), timeout_s, "a reader did not read its slot", alive)
        start = offset + self.header_bytes
        buf[start : start + len(data)] = data
        buf[acks] = bytes(self.num_readers)
        struct.pack_into("<q", buf, offset + 8, len(data))
        _fence()
        struct.pack_into("<q", buf, offset, self.next_seq)  # published
        self.next_seq += 1
        return True

    def unlink(self) -> None:
        """Remove the shared memory (once every reader has attached or is gone)."""
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class RingReader(_Ring):
    """Reader ``index`` of a ring a ``RingWriter`` created under ``name``."""

    def __init__(self, name: str, index: int, num_readers: int, num_slots: int = 4, slot_bytes: int = 4 << 20) -> None:
        shm = shared_memory.SharedMemory(name=name)
        # the writer owns it: this process's resource tracker must not remove it at exit
        resource_tracker.unregister(shm._name, "shared_memory")
        super().__init__(shm, num_readers, num_slots, slot_bytes)
        self.index = index
        self.next_seq = 0

    def read(self, timeout_s: float, alive: Callable[[], bool] | None = None) -> bytes:
        """The next message, in order.

        :raises RingTimeout: nothing was written within ``timeout_s``.
        """
        buf, offset, seq = self.shm.buf, self._offset(self.next_seq), self.next_seq
        self._wait(lambda: struct.unpack_from("<q", buf, offset)[0] == seq, timeout_s, "no message came", alive)
        num_bytes = struct.unpack_from("<q", buf, offset + 8)[0]
        start = offset + self.header_bytes
        data = bytes(buf[start : start + num_bytes])
        _fence()
        buf[offset + HEADER.size + self.index] = 1
        self.next_seq += 1
        return data
