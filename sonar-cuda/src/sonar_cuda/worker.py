"""The CUDA worker: the core worker on one NVIDIA GPU.

Imported only when the CUDA platform is selected (named by ``CudaPlatform.worker_cls``). It is
thin on purpose; CUDA graphs for decode steps will live here.
"""

from __future__ import annotations

import torch

from sonar.worker.worker import Worker


class CudaWorker(Worker):
    """Runs the model on one NVIDIA GPU (``cuda:<rank>``) with the Triton attention backend."""

    def init_device(self) -> None:
        """Make this worker's GPU the current one, so kernels and allocations land on it."""
        torch.cuda.set_device(self.device)
