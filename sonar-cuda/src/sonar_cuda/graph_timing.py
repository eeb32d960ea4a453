"""Timing GPU work the way decode runs it: replayed from a CUDA graph (for benchmarks)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(calls: list[Callable[[], object]], repeats: int = 20) -> float:
    """Microseconds per call of ``calls`` (run once eagerly to compile, then captured as one
    CUDA graph and replayed ``repeats`` times), rounded to 0.01."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(1000 * start.elapsed_time(end) / repeats / len(calls), 2)
