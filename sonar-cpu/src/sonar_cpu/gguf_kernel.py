"""Sonar's C kernel for GGUF block products (Q4_0 / Q4_1 / Q8_0), in ``csrc/gguf_gemm.c``
(built and loaded by ``sonar_cpu.native``).

It holds two products (:func:`gguf_linear`):

- exact: float32 activations, the blocks decoded in registers; equal to the float product up
  to float32 summation order. Steps that carry prompt tokens run it (``sonar.ops.exact_products``).
- int8: the activations rounded first to int8 codes in blocks of 32 (a scale per block), then
  integer dot products against the weight's codes, as llama.cpp runs its CPU products; decode
  steps run it. The rounding is the only difference from the exact product (about 0.2% of a
  product's scale, less than the bfloat16 rounding of torch's int4 kernel it replaces).

A layer's blocks are placed once (:meth:`GGUFBlockKernel.prepare`) in huge-page memory, each
group of four rows interleaved block by block, so that a decode product streams one sequential
run of memory per thread. ``SONAR_CPU_GGUF_KERNEL=0`` (or ``SONAR_CPU_KERNELS=0``) leaves GGUF
layers to their torch paths.
"""

from __future__ import annotations

import os
import threading

import torch

from sonar_cpu.huge_pages import copy_to_huge_pages
from sonar_cpu.native import load

SWITCH_ENV = "SONAR_CPU_GGUF_KERNEL"  # "0": GGUF layers run their torch paths
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0: bytes per block of 32 values
TYPES = tuple(BLOCK_BYTES)
INTERLEAVE = 4  # rows whose blocks are interleaved (the kernel's four-row products)
_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> torch.Tensor:
    """A per-thread buffer of at least ``nbytes``, reused across calls."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer


def interleave_rows(data: torch.Tensor, block_bytes: int, factor: int = INTERLEAVE) -> torch.Tensor:
    """Blocks ``[rows, row_bytes]`` with each group of ``factor`` rows laid out as
    ``[blocks per row, factor, block_bytes]`` (``rows`` a multiple of ``factor``)."""
    rows, row_bytes = data.shape
    grouped = data.reshape(rows // factor, factor, row_bytes // block_bytes, block_bytes)
    return grouped.transpose(1, 2).reshape(rows, row_bytes)


def deinterleave_rows(data: torch.Tensor, block_bytes: int, factor: int = INTERLEAVE) -> torch.Tensor:
    """The inverse of :func:`interleave_rows` (``data``'s first row starts a group)."""
    rows, row_bytes = data.shape
    grouped = data.reshape(rows // factor, row_bytes // block_bytes, factor, block_bytes)
    return grouped.transpose(1, 2).reshape(rows, row_bytes)


def gguf_linear(
    x: torch.Tensor, ggml_type: int, data: torch.Tensor, rows: int, cols: int, exact: bool = True, interleave: int = 1
) -> torch.Tensor:
    """``x [..., cols] @ w.T`` for ``w`` the ``[rows, cols]`` GGUF blocks ``data`` (uint8, as
    stored, or laid out by :func:`interleave_rows` with ``interleave`` 4), in float32;
    ``exact=False`` rounds the activations to int8 blocks first (the fast product). Needs
    :func:`load` to have answered a library."""
    library = load()
    flat = x.reshape(-1, cols)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    num_x = flat.shape[0]
    out = torch.empty(num_x, rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    if exact:
        code = library.gguf_linear(
            ggml_type, data.data_ptr(), interleave, rows, cols, flat.data_ptr(), num_x, out.data_ptr(), threads
        )
    else:
        scratch = _scratch_buffer(library.gguf_q8_scratch_bytes(cols, num_x))
        code = library.gguf_linear_q8(
            ggml_type, data.data_ptr(), interleave, rows, cols, flat.data_ptr(), num_x, out.data_ptr(), threads,
            scratch.data_ptr(),
        )
    if code:
        raise ValueError(
            f"the GGUF C kernel takes Q4_0/Q4_1/Q8_0 with columns a multiple of 32 (and interleaved rows a multiple "
            f"of {INTERLEAVE}), not type {ggml_type}, {rows} x {cols}, interleave {interleave}"
        )
    out = out.reshape(*x.shape[:-1], rows)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class GGUFBlockKernel:
    """The ``gguf_block_kernel`` operation's answer for one layer's blocks of one type.

    ``prepare(data)`` places the blocks where and how the kernel reads them fastest (huge
    pages; four rows interleaved where the rows allow), ``kernel(x, data, rows, cols, exact)``
    multiplies by what ``prepare`` returned, and ``rows_in_order(data, start, stop)`` gives
    rows ``[start, stop)`` back in the file's layout (for callers that dequantize them)."""

    def __init__(self, ggml_type: int) -> None:
        self.ggml_type = ggml_type
        self.block_bytes = BLOCK_BYTES[ggml_type]
        self.interleave = 1

    def prepare(self, data: torch.Tensor) -> torch.Tensor:
        self.interleave = INTERLEAVE if data.shape[0] % INTERLEAVE == 0 else 1
        laid_out = interleave_rows(data, self.block_bytes) if self.interleave > 1 else data
        return copy_to_huge_pages(laid_out.contiguous())

    def rows_in_order(self, data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.interleave == 1:
            return data[start:stop]
        first, last = start - start % self.interleave, -(-stop // self.interleave) * self.interleave
        rows = deinterleave_rows(data[first:last], self.block_bytes, self.interleave)
        return rows[start - first : stop - first]

    def __call__(self, x: torch.Tensor, data: torch.Tensor, rows: int, cols: int, exact: bool = True) -> torch.Tensor:
        return gguf_linear(x, self.ggml_type, data, rows, cols, exact, self.interleave)


def block_kernel(ggml_type: int) -> GGUFBlockKernel | None:
    """A kernel for one layer's blocks of ``ggml_type`` where it runs here, else None (the
    ``gguf_block_kernel`` operation of ``sonar.ops``)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or ggml_type not in TYPES or load() is None:
        return None
    return GGUFBlockKernel(ggml_type)
