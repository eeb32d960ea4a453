"""Sonar's C kernels for GGUF block products: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL in
``csrc/gguf_gemm.c``, the K-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K and IQ4_XS in
``csrc/gguf_kquants.c`` (built and loaded by ``sonar_cpu.native``).

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
vectors, and a product streams one sequential run of memory per thread. The K-quants are laid
out the same way per super-block of 256 values (their 6-bit scales unpacked to bytes). Q5_0,
Q5_1, IQ4_NL and the K-quants run in layout 8 only: a matrix whose rows do not come in groups
of eight gets zero rows to fill its last.
``SONAR_CPU_GGUF_KERNEL=0`` (or ``SONAR_CPU_KERNELS=0``) leaves GGUF layers to their torch paths.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from sonar_cpu.huge_pages import copy_to_huge_pages
from sonar_cpu.native import load

SWITCH_ENV = "SONAR_CPU_GGUF_KERNEL"  # "0": GGUF layers run their torch paths
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23  # GGUF type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18}  # bytes per block of 32 values
#: bytes per super-block of 256 values in the file, and per row in layout 8 (scales unpacked)
K_BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}
K_LANES_BYTES = {Q2_K: 84, Q3_K: 114, Q4_K: 148, Q5_K: 180, Q6_K: 210, IQ4_XS: 138}
TYPES = (*BLOCK_BYTES, *K_BLOCK_BYTES)
LANES_ONLY = (Q5_0, Q5_1, IQ4_NL, *K_BLOCK_BYTES)  # types the kernels take in layout 8 only (rows filled up to eight)
LANES = 8  # rows per group of the kernel's layout 8 (one row per 32-bit lane of a 256-bit vector)
_scratch = threading.local()


def _scratch_buffer(nbytes: int) -> torch.Tensor:
    """A per-thread buffer of at least ``nbytes``, reused across calls."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer


def _chunks(run: torch.Tensor) -> torch.Tensor:
    """``[G, nsb, 8, n]`` bytes of eight rows as vectors of four bytes per row: ``[G, nsb, 8 n]``."""
    groups, nsb, lanes, n = run.shape
    return run.reshape(groups, nsb, lanes, n // 4, 4).transpose(2, 3).reshape(groups, nsb, lanes * n)


def _unchunk(run: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`_chunks`: ``[G, nsb, 8 n]`` -> ``[G, nsb, 8, n]``."""
    groups, nsb = run.shape[:2]
    return run.reshape(groups, nsb, n // 4, LANES, 4).transpose(2, 3).reshape(groups, nsb, LANES, n)


def _across_rows(field: torch.Tensor) -> torch.Tensor:
    """``[G, nsb, 8 rows, k]`` -> ``[G, nsb, k * 8]``: entry ``i`` of every row, then ``i + 1``."""
    return field.transpose(2, 3).reshape(*field.shape[:2], -1)


def _per_row(field: torch.Tensor, k: int) -> torch.Tensor:
    return field.reshape(*field.shape[:2], k, LANES).transpose(2, 3)


def _unpack_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums (uint8)."""
    low_sc, low_m = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    high_sc = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    high_m = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1), torch.cat([low_m, high_m], -1)


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_unpack_k_scales`."""
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    return torch.cat([low, mid, (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], -1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 8 n]`` bits, bit ``8 b + j`` being bit ``j`` of byte ``b``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], -1)


def _bytes(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_bits`."""
    weights = (1 << torch.arange(8, dtype=torch.int32, device=bits.device)).to(torch.uint8)
    return (bits.reshape(*bits.shape[:-1], -1, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _fifth_bits_for_lanes(qh: torch.Tensor) -> torch.Tensor:
    """A 5-bit block's ``qh`` (bit ``v``: value ``v``) reordered so that byte ``i`` holds, at bit
    ``k``, the bit of value ``4 k + i`` (``csrc/gguf_gemm.c`` says why)."""
    return _bytes(_bits(qh).reshape(*qh.shape[:-1], 8, 4).transpose(-1, -2).reshape(*qh.shape[:-1], 32))


def _fifth_bits_from_lanes(reordered: torch.Tensor) -> torch.Tensor:
    return _bytes(_bits(reordered).reshape(*reordered.shape[:-1], 4, 8).transpose(-1, -2).reshape(*reordered.shape[:-1], 32))


def _lanes_fields(ggml_type: int) -> tuple[int, int, int]:
    """``(minimum bytes, fifth-bit bytes, code bytes)`` of one block of ``ggml_type`` in the file
    after its 2-byte scale (IQ4_NL's are Q4_0's: its nibbles index a table)."""
    return (2 if ggml_type in (Q4_1, Q5_1) else 0, 4 if ggml_type in (Q5_0, Q5_1) else 0, 32 if ggml_type == Q8_0 else 16)


def lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF blocks of 32 values ``[rows, row_bytes]`` (``rows`` a multiple of 8) in the kernel's
    layout 8: per group of eight rows and per block, the eight fp16 scales, the eight fp16
    minimums (Q4_1, Q5_1), the eight rows' fifth bits (Q5_0, Q5_1; reordered), then the codes as
    vectors holding four consecutive codes of each row in its 32-bit lane (``csrc/gguf_gemm.c``
    says how). Returns ``[rows, row_bytes]`` bytes, rows no longer apart."""
    rows, row_bytes = data.shape
    block = BLOCK_BYTES[ggml_type]
    blocks = data.reshape(rows // LANES, LANES, row_bytes // block, block).transpose(1, 2)  # [G, nb, 8, block]
    minimum, fifth, _ = _lanes_fields(ggml_type)
    flat = lambda field: field.reshape(*blocks.shape[:2], -1)  # noqa: E731  (the eight rows' fields one after another)
    parts = [flat(blocks[..., 0:2])]  # scales
    if minimum:
        parts.append(flat(blocks[..., 2:4]))
    if fifth:
        parts.append(flat(_fifth_bits_for_lanes(blocks[..., 2 + minimum : 2 + minimum + fifth])))
    parts.append(_chunks(blocks[..., 2 + minimum + fifth :]))
    return torch.cat(parts, dim=-1).reshape(rows, row_bytes)


def rows_from_lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The inverse of :func:`lanes_layout` for whole groups of eight rows."""
    rows, row_bytes = data.shape
    block = BLOCK_BYTES[ggml_type]
    nb = row_bytes // block
    minimum, fifth, codes = _lanes_fields(ggml_type)
    grouped = data.reshape(rows // LANES, nb, LANES * block)
    fields, offset = [], 0
    for width in (2, minimum, fifth):
        if width:
            fields.append(grouped[..., offset : offset + LANES * width].reshape(rows // LANES, nb, LANES, width))
            offset += LANES * width
    if fifth:
        fields[-1] = _fifth_bits_from_lanes(fields[-1])
    fields.append(_unchunk(grouped[..., offset:], codes))
    return torch.cat(fields, dim=-1).transpose(1, 2).reshape(rows, row_bytes)


def _unpack_q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K: 12 bytes -> 16 six-bit scales, less 32, as int8 bytes."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    parts = [
        (low & 0x0F) | ((high & 3) << 4), (mid & 0x0F) | (((high >> 2) & 3) << 4),
        (low >> 4) | (((high >> 4) & 3) << 4), (mid >> 4) | (((high >> 6) & 3) << 4),
    ]
    return (torch.cat(parts, -1).to(torch.int16) - 32).to(torch.int8).view(torch.uint8)


def _pack_q3_k_scales(unpacked: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_unpack_q3_k_scales`."""
    s = (unpacked.view(torch.int8).to(torch.int16) + 32).to(torch.uint8)
    s0, s1, s2, s3 = s[..., 0:4], s[..., 4:8], s[..., 8:12], s[..., 12:16]
    high = (s0 >> 4) | ((s1 >> 4) << 2) | ((s2 >> 4) << 4) | ((s3 >> 4) << 6)
    return torch.cat([(s0 & 0x0F) | ((s2 & 0x0F) << 4), (s1 & 0x0F) | ((s3 & 0x0F) << 4), high], -1)


def _unpack_iq4_xs_scales(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: ``scales_h`` (2 bytes) and ``scales_l`` (4) -> 8 six-bit scales, less 32, as int8 bytes."""
    bits = high[..., 0].to(torch.int32) | (high[..., 1].to(torch.int32) << 8)
    shifts = torch.arange(8, device=high.device)
    top = (bits[..., None] >> (2 * shifts)) & 3
    nibbles = torch.stack([low & 0x0F, low >> 4], dim=-1).reshape(*low.shape[:-1], 8).to(torch.int32)
    return ((nibbles | (top << 4)) - 32).to(torch.int8).view(torch.uint8)


def _pack_iq4_xs_scales(unpacked: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_unpack_iq4_xs_scales`: ``scales_h`` then ``scales_l`` (6 bytes)."""
    ls = unpacked.view(torch.int8).to(torch.int32) + 32
    bits = sum(((ls[..., i] >> 4) & 3) << (2 * i) for i in range(8))
    low = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
    return torch.cat([torch.stack([bits & 0xFF, bits >> 8], -1), low], -1).to(torch.uint8)


def k_lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Q4_K / Q5_K / Q6_K super-blocks ``[rows, row_bytes]`` (``rows`` a multiple of 8) in the
    K-quant kernel's layout 8 (``csrc/gguf_kquants.c`` says how): ``[rows, K_LANES_BYTES * nsb]``."""
    rows, row_bytes = data.shape
    nsb = row_bytes // K_BLOCK_BYTES[ggml_type]
    b = data.reshape(rows // LANES, LANES, nsb, K_BLOCK_BYTES[ggml_type]).transpose(1, 2)  # [G, nsb, 8, block]
    flat = lambda field: field.reshape(*b.shape[:2], -1)  # noqa: E731  (the eight rows' fields one after another)
    if ggml_type == IQ4_XS:  # file: d 0:2, scales_h 2:4, scales_l 4:8, qs 8:136
        parts = [flat(b[..., 0:2]), _across_rows(_unpack_iq4_xs_scales(b[..., 2:4], b[..., 4:8])), _chunks(b[..., 8:136])]
    elif ggml_type == Q2_K:  # file: scales 0:16, qs 16:80, d 80:82, dmin 82:84
        parts = [flat(b[..., 80:82]), flat(b[..., 82:84]), _across_rows(b[..., 0:16]), _chunks(b[..., 16:80])]
    elif ggml_type == Q3_K:  # file: hmask 0:32, qs 32:96, scales 96:108, d 108:110
        parts = [flat(b[..., 108:110]), _across_rows(_unpack_q3_k_scales(b[..., 96:108])), _chunks(b[..., 0:32]), _chunks(b[..., 32:96])]
    elif ggml_type == Q6_K:
        ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        parts = [d.reshape(*b.shape[:2], -1), _across_rows(sc)]
        for half in range(2):
            parts += [_chunks(ql[..., 64 * half : 64 * half + 64]), _chunks(qh[..., 32 * half : 32 * half + 32])]
    else:
        sc, m = _unpack_k_scales(b[..., 4:16])
        parts = [b[..., 0:2].reshape(*b.shape[:2], -1), b[..., 2:4].reshape(*b.shape[:2], -1), _across_rows(sc), _across_rows(m)]
        if ggml_type == Q5_K:
            parts.append(_chunks(b[..., 16:48]))
        parts.append(_chunks(b[..., -128:]))
    return torch.cat(parts, dim=-1).reshape(rows, nsb * K_LANES_BYTES[ggml_type])


def rows_from_k_lanes_layout(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The inverse of :func:`k_lanes_layout` for whole groups of eight rows."""
    rows = data.shape[0]
    nsb = data.shape[1] // K_LANES_BYTES[ggml_type]
    g = data.reshape(rows // LANES, nsb, LANES * K_LANES_BYTES[ggml_type])
    if ggml_type == IQ4_XS:
        d = g[..., 0:16].reshape(*g.shape[:2], LANES, 2)
        blocks = torch.cat([d, _pack_iq4_xs_scales(_per_row(g[..., 16:80], 8)), _unchunk(g[..., 80:1104], 128)], -1)
    elif ggml_type == Q2_K:
        d, dmin = g[..., 0:16].reshape(*g.shape[:2], LANES, 2), g[..., 16:32].reshape(*g.shape[:2], LANES, 2)
        blocks = torch.cat([_per_row(g[..., 32:160], 16), _unchunk(g[..., 160:672], 64), d, dmin], -1)
    elif ggml_type == Q3_K:
        d = g[..., 0:16].reshape(*g.shape[:2], LANES, 2)
        scales = _pack_q3_k_scales(_per_row(g[..., 16:144], 16))
        blocks = torch.cat([_unchunk(g[..., 144:400], 32), _unchunk(g[..., 400:912], 64), scales, d], -1)
    elif ggml_type == Q6_K:
        d = g[..., 0:16].reshape(*g.shape[:2], LANES, 2)
        sc = _per_row(g[..., 16:144], 16)
        halves = [g[..., 144 + 768 * half : 144 + 768 * (half + 1)] for half in range(2)]
        ql = torch.cat([_unchunk(h[..., 0:512], 64) for h in halves], -1)
        qh = torch.cat([_unchunk(h[..., 512:768], 32) for h in halves], -1)
        blocks = torch.cat([ql, qh, sc, d], -1)
    else:
        d, dmin = g[..., 0:16].reshape(*g.shape[:2], LANES, 2), g[..., 16:32].reshape(*g.shape[:2], LANES, 2)
        fields = [d, dmin, _pack_k_scales(_per_row(g[..., 32:96], 8), _per_row(g[..., 96:160], 8))]
        if ggml_type == Q5_K:
            fields.append(_unchunk(g[..., 160:416], 32))
        fields.append(_unchunk(g[..., -1024:], 128))
        blocks = torch.cat(fields, -1)
    return blocks.transpose(1, 2).reshape(rows, nsb * K_BLOCK_BYTES[ggml_type])


def gguf_linear(
    x: torch.Tensor, ggml_type: int, data: torch.Tensor, rows: int, cols: int, exact: bool = True, layout: int = 1
) -> torch.Tensor:
    """``x [..., cols] @ w.T`` for ``w`` the ``[rows, cols]`` GGUF blocks ``data`` (uint8, as
    stored, or laid out by :func:`lanes_layout` with ``layout`` 8; K-quants only laid out by
    :func:`k_lanes_layout`, ``rows`` a multiple of 8), in float32; ``exact=False`` rounds the
    activations to int8 blocks first (the fast product). Needs :func:`load` to have answered a
    library."""
    library = load()
    flat = x if x.dim() == 2 else x.reshape(-1, cols)  # (a reshape costs about a microsecond: decode calls this ~120 times a token)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    num_x = flat.shape[0]
    out = torch.empty(num_x, rows, dtype=torch.float32)
    threads = torch.get_num_threads()
    if ggml_type in K_BLOCK_BYTES:
        scratch = _scratch_buffer(_scratch_bytes(True, cols, num_x))
        code = layout != LANES or library.gguf_k_linear(
            ggml_type, data.data_ptr(), rows, cols, flat.data_ptr(), num_x, out.data_ptr(), threads, scratch.data_ptr(), int(exact)
        )
        if code:
            raise ValueError(f"the GGUF C kernel takes K-quants in layout {LANES} with rows a multiple of {LANES} and columns of 256, not type {ggml_type}, {rows} x {cols}, layout {layout}")
    else:
        scratch = _scratch_buffer(_scratch_bytes(False, cols, num_x))
        product = library.gguf_linear if exact else library.gguf_linear_q8
        code = product(ggml_type, data.data_ptr(), layout, rows, cols, flat.data_ptr(), num_x, out.data_ptr(), threads, scratch.data_ptr())
        if code:
            raise ValueError(
                f"the GGUF C kernel takes Q4_0/Q4_1/Q8_0 (Q5_0/Q5_1/IQ4_NL in layout {LANES} only) with columns a multiple of 32 "
                f"(and rows a multiple of {LANES} in layout {LANES}), not type {ggml_type}, {rows} x {cols}, layout {layout}"
            )
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], rows)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


@functools.lru_cache(maxsize=4096)
def _scratch_bytes(k_quant: bool, cols: int, num_x: int) -> int:
    """The scratch size the C kernel (the K-quants' or the 32-value types') needs for ``num_x``
    rows of ``cols`` inputs, asked once per shape."""
    library = load()
    return (library.gguf_k_scratch_bytes if k_quant else library.gguf_q8_scratch_bytes)(cols, num_x)


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
    k_quant = ggml_type in K_BLOCK_BYTES
    scratch = _scratch_buffer((library.gguf_k_scratch_bytes if k_quant else library.gguf_q8_scratch_bytes)(cols, num_x))
    product = library.gguf_k_linear_experts if k_quant else library.gguf_linear_q8_experts
    code = product(
        ggml_type, pointers.data_ptr(), pointers.numel(), starts.data_ptr(), rows, cols, flat.data_ptr(), out.data_ptr(),
        torch.get_num_threads(), scratch.data_ptr(),
    )
    if code:
        width = 256 if k_quant else 32
        raise ValueError(f"the GGUF C kernel takes experts of rows a multiple of {LANES} and columns of {width}, not type {ggml_type}, {rows} x {cols}")
    return out


class GGUFBlockKernel:
    """The ``gguf_block_kernel`` operation's answer for one layer's blocks of one type.

    ``prepare(data)`` places the blocks where and how the kernel reads them fastest (huge
    pages; layout 8 where the rows come in groups of eight, and always for Q5_0, Q5_1, IQ4_NL and
    the K-quants, whose last group is filled with zero rows), ``kernel(x, data, rows, cols,
    exact)`` multiplies by what ``prepare`` returned, and ``rows_in_order(data, start, stop)``
    gives rows ``[start, stop)`` back in the file's layout (for callers that dequantize them)."""

    def __init__(self, ggml_type: int) -> None:
        self.ggml_type = ggml_type
        self.k_quant = ggml_type in K_BLOCK_BYTES
        self.layout = 1

    def prepare(self, data: torch.Tensor) -> torch.Tensor:
        if self.ggml_type in LANES_ONLY and data.shape[0] % LANES:  # zero blocks: d = 0, so the filled rows' products are 0
            data = torch.cat([data, data.new_zeros(LANES - data.shape[0] % LANES, data.shape[1])])
        self.layout = LANES if data.shape[0] % LANES == 0 else 1
        if self.layout == 1:
            return copy_to_huge_pages(data.contiguous())
        return copy_to_huge_pages((k_lanes_layout if self.k_quant else lanes_layout)(data, self.ggml_type).contiguous())

    def rows_in_order(self, data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.layout == 1:
            return data[start:stop]
        first, last = start - start % LANES, -(-stop // LANES) * LANES
        unlay = rows_from_k_lanes_layout if self.k_quant else rows_from_lanes_layout
        return unlay(data[first:last], self.ggml_type)[start - first : stop - first]

    def __call__(self, x: torch.Tensor, data: torch.Tensor, rows: int, cols: int, exact: bool = True) -> torch.Tensor:
        if data.shape[0] != rows:  # the rows filled up to a group of eight
            return gguf_linear(x, self.ggml_type, data, data.shape[0], cols, exact, self.layout)[..., :rows]
        return gguf_linear(x, self.ggml_type, data, rows, cols, exact, self.layout)

    def experts(self, x: torch.Tensor, pointers: torch.Tensor, starts: torch.Tensor, rows: int, cols: int) -> torch.Tensor | None:
        """The int8 product of several prepared matrices of this type at once
        (:func:`gguf_linear_experts`); None where they are not in layout 8 or their rows were
        filled up."""
        if self.layout != LANES or rows % LANES:
            return None
        return gguf_linear_experts(x, self.ggml_type, pointers, starts, rows, cols)


def block_kernel(ggml_type: int) -> GGUFBlockKernel | None:
    """A kernel for one layer's blocks of ``ggml_type`` where it runs here, else None (the
    ``gguf_block_kernel`` operation of ``sonar.ops``)."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or ggml_type not in TYPES or load() is None:
        return None
    return GGUFBlockKernel(ggml_type)
