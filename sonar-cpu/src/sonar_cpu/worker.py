"""The CPU worker: the generic worker, with PyTorch's intra-op threads set for this host."""

from __future__ import annotations

from sonar.worker.worker import Worker

from sonar_cpu.threads import configure_threads


class CpuWorker(Worker):
    """Runs the model on the host CPU.

    Everything but thread setup is the generic ``sonar.worker.worker.Worker``: the CPU needs no
    streams or graphs. Threads are set (``SONAR_CPU_THREADS``, else every usable core) in
    ``init_device``, before the model is built, so weight loading already uses them.
    """

    num_threads: int = 0

    def init_device(self) -> None:
        """Set torch's intra-op thread count for this process."""
        self.num_threads = configure_threads()
