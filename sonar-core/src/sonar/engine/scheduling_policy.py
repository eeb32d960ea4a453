"""Scheduling policies: the order of the waiting queue and the choice of preemption victims.

A policy is registered through ``sonar_register_scheduler_policies`` and selected with
``scheduling_policy=`` (``--scheduling-policy``). The scheduler keeps the mechanics (token
budget, sequence cap, chunked prefill, KV blocks); the policy only answers two questions:
which waiting request is admitted next, and which running request gives its blocks back when
a step runs out of them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator

from sonar.engine.request import Request


class WaitingQueue:
    """The requests waiting to be admitted, in the order a policy admits them."""

    def add(self, request: Request) -> None:
        """Queue a new request."""
        raise NotImplementedError

    def add_preempted(self, request: Request) -> None:
        """Queue a request preempted from the running set (it comes back before its peers)."""
        raise NotImplementedError

    def peek(self) -> Request:
        """The request admitted next (the queue is not empty)."""
        raise NotImplementedError

    def pop(self) -> Request:
        """Remove and return ``peek()``."""
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Take out a request that finished or was aborted while waiting."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class SchedulingPolicy:
    """How the scheduler orders its work. Subclass it and register the subclass.

    :cvar uses_priority: whether requests' ``priority`` means anything to this policy; a
        request with a non-zero priority is refused at admission when it does not.
    """

    uses_priority: bool = False

    def new_waiting_queue(self) -> WaitingQueue:
        """An empty waiting queue ordered by this policy."""
        raise NotImplementedError

    def select_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out; ``candidates`` is never
        empty and lists the running requests in the order they were admitted."""
        raise NotImplementedError


# -- first come, first served ---------------------------------------------------------------


class FifoQueue(WaitingQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: waiting requests in arrival order (a preempted request first
    of all), and the newest running request is preempted."""

    def new_waiting_queue(self) -> WaitingQueue:
        return FifoQueue()

    def select_victim(self, candidates: list[Request]) -> Request:
        return candidates[-1]


# -- priority -------------------------------------------------------------------------------


def priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first; among equals, the earlier arrival."""
    return request.priority, request.arrival_time


class PriorityQueue(WaitingQueue):
    """A heap on ``(priority, arrival_time)``; removal is lazy (an entry whose request left is
    skipped when it reaches the top)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._members: set[int] = set()  # id() of the requests queued

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))
        self._members.add(id(request))

    add_preempted = add  # a preempted request keeps its place: its key is unchanged

    def _drop_stale(self) -> None:
        while self._heap and id(self._heap[0][3]) not in self._members:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_stale()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_stale()
        request = heapq.heappop(self._heap)[3]
        self._members.discard(id(request))
        return request

    def remove(self, request: Request) -> None:
        if id(request) not in self._members:
            raise ValueError("request is not waiting")
        self._members.discard(id(request))
        if len(self._heap) > 2 * len(self._members) + 64:  # keep stale entries bounded
            self._heap = [entry for entry in self._heap if id(entry[3]) in self._members]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap if id(entry[3]) in self._members)

    def __contains__(self, request: object) -> bool:
        return id(request) in self._members


class PriorityPolicy(SchedulingPolicy):
    """Requests' ``priority``: lower values run first, first come first served among equals;
    preemption takes the running request with the highest value (the latest arrival among
    equals)."""

    uses_priority = True

    def new_waiting_queue(self) -> WaitingQueue:
        return PriorityQueue()

    def select_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=priority_key)
