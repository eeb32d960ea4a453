"""Sonar's C kernel for GGUF block products (Q4_0 / Q4_1 / Q8_0), in ``csrc/gguf_gemm.c``
(built and loaded by ``sonar_cpu.native``).

It holds two products (:func:`gguf_linear`):

- exact: float32 activations, the blocks decoded in registers; equal to the float product up
  to float32 summation order. Steps that carry prompt tokens run it (``sonar.ops.exact_products``).
- int8: the activations rounded first to int8 codes in blocks of 32 (a scale per block), then
  integer dot products against the weight's codes, as llama.cpp runs its CPU products; decode
  steps run it. The rounding is the only difference from the exact product (about 0.2% of a
  product's scale, less than the bfloat16 rounding of torch's int4 kernel it replaces).

A layer's blocks are placed once (:meth:`GGUFBlockKernel.prepare`) in huge-page memory, laid
out so that each 256-bit vector holds eight weight rows, one per 32-bit lane (layout 8): a
block's products for eight rows are then eight integer dot instructions, its scales apply as
vectors, and a product streams one sequential run of memory per thread.
``SONAR_CPU_GGUF_KERNEL=0`` (or ``SONAR_CPU_KERNELS=0``) leaves GGUF layers to their torch paths.
"""

from __future__ import annotations

import os
import threading

import torch

from sonar_cpu.huge_pages import copy_to_huge_pages
from sonar_cpu.native import load

SWITCH_ENV = "SONAR_CPU_GGUF_KERNEL"  # "0": GGUF layers run their torch paths
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGUF type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # bytes per block of 32 values
TYPES = tuple(BLOCK_BYTES)
LANES = 8  # rows per group of the kernel's layout 8 (one row per 32-bit lane of a 256-bit vector)
_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> torch.Tensor:
    """A per-thread buffer of at least ``nbytes``, reused across calls."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer


def lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF blocks ``[rows, row_bytes]`` (``rows`` a multiple of 8) in the kernel's layout 8: per
    group of eight rows and per block, the eight fp16 scales, the eight fp16 minimums (Q4_1),
    then the codes as vectors holding four consecutive codes of each row in its 32-bit lane
    (``csrc/gguf_gemm.c`` says how). Returns ``[rows, row_bytes]`` bytes, rows no longer apart."""
    rows, row_bytes = data.shape
    block = BLOCK_BYTES[ggml_type]
    blocks = data.reshape(rows // LANES, LANES, row_bytes // block, block).transpose(1, 2)  # [G, nb, 8, block]
    head = 4 if ggml_type == Q4_1 else 2  # bytes of scale (and minimum) before the codes
    parts = [blocks[..., 0:2].reshape(*blocks.shape[:2], 2 * LANES)]  # scales
    if ggml_type == Q4_1:
        parts.append(blocks[..., 2:4].reshape(*blocks.shape[:2], 2 * LANES))  # minimums
    codes = blocks[..., head:]  # [G, nb, 8, 16 or 32]
    chunks = codes.reshape(*codes.shape[:3], -1, 4).transpose(2, 3)  # [G, nb, chunks, 8, 4]
    parts.append(chunks.reshape(*blocks.shape[:2], -1))
    return torch.cat(parts, dim=-1).reshape(rows, row_bytes)


def rows_from_lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The inverse of :func:`lanes_layout` for whole groups of eight rows."""
    rows, row_bytes = data.shape
    block = BLOCK_BYTES[ggml_type]
    nb, head = row_bytes // block, (4 if ggml_type == Q4_1 else 2)
    grouped = data.reshape(rows // LANES, nb, LANES * block)
    fields = [grouped[..., 0 : 2 * LANES].reshape(rows // LANES, nb, LANES, 2)]
    offset = 2 * LANES
    if ggml_type == Q4_1:
        fields.append(grouped[..., offset : offset + 2 * LANES].reshape(rows // LANES, nb, LANES, 2))
        offset += 2 * LANES
    chunks = grouped[..., offset:].reshape(rows // LANES, nb, -1, LANES, 4).transpose(2, 3)  # [G, nb, 8, chunks, 4]
    fields.append(chunks.reshape(rows // LANES, nb, LANES, block - head))
    blocks = torch.cat(fields, dim=-1)  # [G, nb, 8, block]
    return blocks.transpose(1, 2).reshape(rows, row_bytes)


def gguf_linear(
    x: torch.Tensor, ggml_type: int, data: torch.Tensor, rows: int, cols: int, exact: bool = True, layout: int = 1
) -> torch.Tensor:
    """``x [..., cols] @ w.T`` for ``w`` the ``[rows, cols]`` GGUF blocks ``data`` (uint8, as
    stored, or laid out by :func:`lanes_layout` with ``layout`` 8), in float32;
    ``exact=False`` rounds the activations to int8 blocks first (the fast product). Needs
    :func:`load` to have answered a library."""
    library = load()
    flat = x.reshape(-1, cols)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    num_x = flat.shape[0]
    out = torch.empty(num_x, rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    scratch = _scratch_buffer(library.gguf_q8_scratch_bytes(cols, num_x))
    product = library.gguf_linear if exact else library.gguf_linear_q8
    code = product(ggml_type, data.data_ptr(), layout, rows, cols, flat.data_ptr(), num_x, out.data_ptr(), threads, scratch.data_ptr())
    if code:
        raise ValueError(
            f"the GGUF C kernel takes Q4_0/Q4_1/Q8_0 with columns a multiple of 32 (and rows a multiple of {LANES} "
            f"in layout {LANES}), not type {ggml_type}, {rows} x {cols}, layout {layout}"
        )
    out = out.reshape(*x.shape[:-1], rows)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def gguf_linear_experts(
    x: torch.Tensor, ggml_type: int, pointers: torch.Tensor, starts: torch.Tensor, rows: int, cols: int
) -> torch.Tensor:
    """The int8 product of several matrices of one shape and type in one call: matrix ``j``
    (layout 8, its blocks at address ``pointers[j]``) multiplies rows ``starts[j]`` to
    ``starts[j + 1]`` of ``x [starts[-1], cols]``; returns ``[starts[-1], rows]`` float32 (a
    mixture-of-experts layer's chosen experts, each over its own tokens)."""
    library = load()
    flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    num_x = flat.shape[0]
    out = torch.empty(num_x, rows, dtype=torch.float32)
    scratch = _scratch_buffer(library.gguf_q8_scratch_bytes(cols, num_x))
    code = library.gguf_linear_q8_experts(
        ggml_type, pointers.data_ptr(), pointers.numel(), starts.data_ptr(), rows, cols, flat.data_ptr(), out.data_ptr(),
        torch.get_num_threads(), scratch.data_ptr(),
    )
    if code:
        raise ValueError(f"the GGUF C kernel takes Q4_0/Q4_1/Q8_0 experts of rows a multiple of {LANES} and columns of 32, not type {ggml_type}, {rows} x {cols}")
    return out


class GGUFBlockKernel:
    """The ``gguf_block_kernel`` operation's answer for one layer's blocks of one type.

    ``prepare(data)`` places the blocks where and how the kernel reads them fastest (huge
    pages; layout 8 where the rows come in groups of eight), ``kernel(x, data, rows, cols,
    exact)`` multiplies by what ``prepare`` returned, and ``rows_in_order(data, start, stop)``
    gives rows ``[start, stop)`` back in the file's layout (for callers that dequantize them)."""

    def __init__(self, ggml_type: int) -> None:
        self.ggml_type = ggml_type
        self.layout = 1

    def prepare(self, data: torch.Tensor) -> torch.Tensor:
        self.layout = LANES if data.shape[0] % LANES == 0 else 1
        laid_out = lanes_layout(data, self.ggml_type) if self.layout == LANES else data
        return copy_to_huge_pages(laid_out.contiguous())

    def rows_in_order(self, data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.layout == 1:
            return data[start:stop]
        first, last = start - start % LANES, -(-stop // LANES) * LANES
        return rows_from_lanes_layout(data[first:last], self.ggml_type)[start - first : stop - first]

    def __call__(self, x: torch.Tensor, data: torch.Tensor, rows: int, cols: int, exact: bool = True) -> torch.Tensor:
        return gguf_linear(x, self.ggml_type, data, rows, cols, exact, self.layout)

    def experts(self, x: torch.Tensor, pointers: torch.Tensor, starts: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
        """The int8 product of several prepared matrices of this type at once
        (:func:`gguf_linear_experts`); None where they are not in layout 8."""
        if self.layout != LANES:
            return None
        return gguf_linear_experts(x, self.ggml_type, pointers, starts, rows, cols)


def block_kernel(ggml_type: int) -> GGUFBlockKernel | None:
    """A kernel for one layer's blocks of ``ggml_type`` where it runs here, else None (the
    ``gguf_block_kernel`` operation of ``sonar.ops``)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or ggml_type not in TYPES or load() is None:
        return None
    return GGUFBlockKernel(ggml_type)
