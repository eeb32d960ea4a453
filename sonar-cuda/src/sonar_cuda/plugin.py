"""Registers the ``cuda`` platform. Detection is cheap: it looks for the NVIDIA driver's device
files before asking torch, and never imports Triton or this package's kernels."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from typing import Callable

from sonar.hookspecs import hookimpl

logger = logging.getLogger(__name__)

PLATFORM_CLASS = "sonar_cuda.platform:CudaPlatform"


def _driver_visible() -> str | None:
    """Why we think an NVIDIA driver is present, or None."""
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/nvidiactl"):
        return "NVIDIA device files present"
    if os.path.exists("/proc/driver/nvidia/version"):
        return "NVIDIA driver loaded"
    if os.path.exists("/dev/dxg"):  # WSL2 exposes GPUs through /dev/dxg only
        return "WSL GPU device present"
    return None


def detect_cuda() -> str | None:
    """The CUDA platform's class path when an NVIDIA GPU is usable, else None (logged at debug)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        logger.debug("cuda: CUDA_VISIBLE_DEVICES=%r hides every GPU", visible)
        return None
    if _driver_visible() is None:
        logger.debug("cuda: no NVIDIA driver or device files found")
        return None
    if importlib.util.find_spec("triton") is None:
        logger.debug("cuda: an NVIDIA GPU is present but triton is not installed")
        return None
    import torch  # already imported by sonar.platform; asks the driver for a count, no context

    if torch.version.cuda is None:
        logger.debug("cuda: this torch build has no CUDA support (torch %s)", torch.__version__)
        return None
    if not torch.cuda.is_available():
        logger.debug("cuda: the driver is present but torch sees no usable GPU")
        return None
    return PLATFORM_CLASS


@hookimpl
def sonar_register_platforms(register: Callable[..., None]) -> None:
    register("cuda", detect_cuda)
