"""The CUDA worker: the core worker on one NVIDIA GPU.

Imported only when the CUDA platform is selected (named by ``CudaPlatform.worker_cls``). It is
thin on purpose; CUDA graphs for decode steps will live here.
"""

from __future__ import annotations

from sonar.worker.worker import Worker


class CudaWorker(Worker):
    """Runs the model on one NVIDIA GPU with the Triton attention backend."""
