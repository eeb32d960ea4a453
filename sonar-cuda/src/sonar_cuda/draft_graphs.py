"""CUDA graphs of a drafter's passes (EAGLE-3, DFlash, DSpark): the core's ``DraftPass``
decides the shapes and owns the static inputs; this captures each (batch size, slots) pass
once, as the target's decode graphs are captured, and replays it.

Every pass is captured into one private memory pool, warmed up first (kernels compiled,
allocator blocks cached outside the capture). A capture reads and writes only the drafter
cache's scratch block: the inputs hold the padding row while capturing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphCapturer:
    """Captures drafter passes on the current CUDA device into one shared graph pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Warm ``run`` up, capture it, and return its replay: it refills the tensors the
        capture returned (outputs of the graph, valid until the next replay)."""
        run()  # warm-up: compiles kernels, caches allocations outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run()
        self.graphs.append(graph)

        def replay() -> tuple[torch.Tensor, ...]:
            graph.replay()
            return outputs

        return replay

    def synchronize(self) -> None:
        torch.cuda.synchronize()
