"""Registers ``shortest-first``: waiting requests with the fewest prompt tokens are admitted
first (arrival order among equals); when blocks run out, the running request with the most
tokens is preempted."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator

from sonar.engine.request import Request
from sonar.engine.scheduling_policy import SchedulingPolicy, WaitingQueue
from sonar.hookspecs import hookimpl


class ShortestFirstQueue(WaitingQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.num_prompt_tokens, request.arrival_time, next(self._counter), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


class ShortestFirstPolicy(SchedulingPolicy):
    def new_waiting_queue(self) -> WaitingQueue:
        return ShortestFirstQueue()

    def select_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.num_tokens, r.arrival_time))


@hookimpl
def sonar_register_scheduler_policies(register: Callable[..., None]) -> None:
    register("shortest-first", ShortestFirstPolicy)
