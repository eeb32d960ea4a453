"""The CPU worker: the generic worker, with PyTorch's intra-op threads set for this host."""

from __future__ import annotations

from typing import Any

from sonar.worker.worker import Worker

from sonar_cpu.threads import configure_threads


class CpuWorker(Worker):
    """Runs the model on the host CPU.

    Everything but thread setup is the generic ``sonar.worker.worker.Worker``: the CPU needs no
    device initialisation, graphs or streams. Threads are set (``SONAR_CPU_THREADS``, else every
    usable core) before the parent builds anything, so weight loading already uses them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.num_threads = configure_threads()
        super().__init__(*args, **kwargs)
