"""A least-recently-used cache bounded both in entries and in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedCache(Generic[V]):
    """Keeps at most ``max_entries`` values totalling at most ``max_bytes``; the least recently
    used go first. A value larger than ``max_bytes`` alone is not kept. Thread-safe.

    :param max_entries: most values held.
    :param max_bytes: most bytes held (as the caller sizes each value).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"cache bounds must be positive, got {max_entries} entries, {max_bytes} bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.num_misses += 1
                return None
            self._items.move_to_end(key)
            self.num_hits += 1
            return item[0]

    def put(self, key: Hashable, value: V, num_bytes: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._num_bytes -= old[1]
            if num_bytes > self.max_bytes:
                return
            self._items[key] = (value, num_bytes)
            self._num_bytes += num_bytes
            while len(self._items) > self.max_entries or self._num_bytes > self.max_bytes:
                _, (_, evicted_bytes) = self._items.popitem(last=False)
                self._num_bytes -= evicted_bytes
                self.num_evictions += 1

    @property
    def num_entries(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._num_bytes = 0
