"""The CUDA worker: the core worker on one NVIDIA GPU, with the CUDA model runner.

Imported only when the CUDA platform is selected (named by ``CudaPlatform.worker_cls``).
"""

from __future__ import annotations

import os

import torch

from sonar.worker.worker import Worker
from sonar_cuda.model_runner import CudaModelRunner


class CudaWorker(Worker):
    """Runs the model on one NVIDIA GPU (``cuda:<rank>``): Triton attention and kernels, CUDA
    graphs for decode steps (:class:`~sonar_cuda.model_runner.CudaModelRunner`)."""

    model_runner_cls = CudaModelRunner

    def init_device(self) -> None:
        """Make this worker's GPU the current one, so kernels and allocations land on it, and
        let the caching allocator grow segments in place (steps of many shapes then leave no
        fragments cached beside the KV cache, so the memory profile holds at run time) unless
        ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise."""
        if self.device.type == "cuda":
            if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            torch.cuda.set_device(self.device)
