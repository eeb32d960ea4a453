"""KV blocks between two engines on one GPU without leaving it: CUDA IPC.

The prefill side exports each layer's KV-cache tensor once (:func:`export_kv_caches`: the CUDA
driver's IPC handle of the allocation holding it, as plain bytes); the decode side maps them
once per prefill engine (:func:`import_kv_caches`) and gathers a request's blocks straight from
the other process's cache into its own, at the device's memory bandwidth instead of two host
copies and a socket.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from sonar.kv_transfer.kv_wire import CudaIpcHandle

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def host_identity() -> str:
    """This machine: its host name and boot id (two processes agree only on one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    """The GPU ``device`` is, by its UUID ("" for anything else)."""
    import torch

    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_of(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (None: not visible here)."""
    import torch

    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def export_kv_caches(kv_caches: list[torch.Tensor]) -> list[CudaIpcHandle]:
    """IPC handles of every layer's cache (``[2, num_blocks, ...]``, contiguous).

    :raises RuntimeError: the caches cannot be shared (not on a GPU, or in memory CUDA IPC
        cannot export).
    """
    handles = []
    for kv in kv_caches:
        if kv.device.type != "cuda" or not kv.is_contiguous():
            raise RuntimeError("only contiguous KV caches on a GPU are shared through CUDA IPC")
        (_, handle, size, offset, ref_handle, ref_offset, event, event_sync) = kv.untyped_storage()._share_cuda_()
        handles.append(
            CudaIpcHandle(bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset), bytes(event), bool(event_sync), kv.storage_offset(), kv.shape[1])
        )
    return handles


def import_kv_caches(handles: list[CudaIpcHandle], like: list[torch.Tensor], device_index: int) -> list[torch.Tensor]:
    """The other engine's caches mapped into this process, shaped as ``like`` (this engine's
    caches) but with the other's number of blocks.

    :raises ValueError: a handle describes less memory than its tensor needs.
    """
    import torch

    if len(handles) != len(like):
        raise ValueError(f"{len(handles)} IPC handles for {len(like)} layers")
    tensors = []
    for shared, mine in zip(handles, like):
        shape = (mine.shape[0], shared.num_blocks, *mine.shape[2:])
        needed = (shared.tensor_offset + torch.Size(shape).numel()) * mine.element_size()
        if shared.num_blocks < 1 or shared.tensor_offset < 0 or needed > shared.storage_size_bytes:
            raise ValueError(f"an IPC handle of {shared.storage_size_bytes} bytes for a cache of {needed}")
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index, shared.handle, shared.storage_size_bytes, shared.storage_offset_bytes,
            shared.ref_counter_handle, shared.ref_counter_offset, shared.event_handle, shared.event_sync_required,
        )
        tensor = torch.empty(0, dtype=mine.dtype, device=mine.device)
        tensor.set_(storage, shared.tensor_offset, shape)
        tensors.append(tensor)
    return tensors
