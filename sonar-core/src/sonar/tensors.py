"""Host-to-device copies that never wait for the device."""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` on ``device`` without a host synchronisation.

    A copy from ordinary (pageable) host memory makes the host wait for the device's queued
    work; staging through pinned memory lets the host go on while the device runs the step
    before, which asynchronous scheduling relies on. On the CPU this is a plain conversion.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
