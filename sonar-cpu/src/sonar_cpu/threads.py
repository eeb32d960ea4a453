"""How many threads PyTorch's CPU kernels use."""

from __future__ import annotations

import logging
import os

import torch

from sonar_cpu.platform import num_usable_cores

logger = logging.getLogger(__name__)

THREADS_ENV = "SONAR_CPU_THREADS"


def configure_threads() -> int:
    """Set torch's intra-op thread count: ``SONAR_CPU_THREADS`` if set, else every usable core.
    Returns the count set."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            num_threads = int(raw)
        except ValueError:
            raise ValueError(f"{THREADS_ENV}={raw!r} is not an integer; set it to a thread count such as 4") from None
        if num_threads < 1:
            raise ValueError(f"{THREADS_ENV}={num_threads} must be at least 1")
    else:
        num_threads = num_usable_cores()
    torch.set_num_threads(num_threads)
    logger.debug("torch intra-op threads: %d", num_threads)
    return num_threads
