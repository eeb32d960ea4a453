"""Weights copied into memory backed by transparent huge pages.

A decode step of a small quantized model streams every weight once, and with 4 KiB pages a
96 MB model spans some 24,000 of them: far more than the TLB holds, so the products stall on
page walks. Copied into anonymous memory advised ``MADV_HUGEPAGE``, the same weights span ~50
pages of 2 MiB, and the embedded model's products ran about 15% faster (measured on 2 cores).

Tensors are placed one after another in chunks of ``CHUNK_BYTES`` (or one chunk of their own
when larger); a chunk is unmapped when the last tensor placed in it is freed, except the chunk
being filled, which stays mapped until the next one replaces it (at most ``CHUNK_BYTES``). Where the system
does not do transparent huge pages, the copy is still correct, only not faster.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 32 << 20
ALIGN_BYTES = 64
_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the chunk being filled (uint8)
_used = 0


def _new_chunk(nbytes: int) -> torch.Tensor:
    size = -(-max(nbytes, CHUNK_BYTES) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(region, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: plain pages
            pass
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive


def copy_to_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor ``tensor`` in huge-page memory."""
    global _chunk, _used
    nbytes = tensor.numel() * tensor.element_size()
    with _lock:
        if _chunk is None or _used + nbytes > _chunk.numel():
            _chunk, _used = _new_chunk(nbytes), 0
        place = _chunk[_used : _used + nbytes]
        _used += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    out = place.view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
