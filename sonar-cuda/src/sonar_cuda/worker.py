"""The CUDA worker: the core worker on one NVIDIA GPU, with the CUDA model runner.

Imported only when the CUDA platform is selected (named by ``CudaPlatform.worker_cls``).
"""

from __future__ import annotations

import torch

from sonar.worker.worker import Worker
from sonar_cuda.model_runner import CudaModelRunner


class CudaWorker(Worker):
    """Runs the model on one NVIDIA GPU (``cuda:<rank>``): Triton attention and kernels, CUDA
    graphs for decode steps (:class:`~sonar_cuda.model_runner.CudaModelRunner`)."""

    model_runner_cls = CudaModelRunner

    def init_device(self) -> None:
        """Make this worker's GPU the current one, so kernels and allocations land on it."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
