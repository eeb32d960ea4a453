"""Sonar's NVIDIA platform: Triton kernels over the paged KV cache, the CUDA worker and platform.

Importing this package imports neither torch.cuda state nor Triton; the kernels live in
``sonar_cuda.kernels`` and load on first use.
"""

__version__ = "0.1.0"
