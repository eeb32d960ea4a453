"""llama.cpp's quantized blocks, decoded in PyTorch (on any device).

A quantized GGUF matrix ``[rows, cols]`` is stored row by row, each row a run of fixed-size
blocks along ``cols``. ``GGUFBlocks`` holds those bytes as ``uint8 [rows, row_bytes]``, so rows
can be sliced, permuted and stacked without decoding. ``dequantize_blocks`` turns them into
floats; ``int4_groups`` re-expresses the formats whose groups of 32 are affine in a 4-bit code
(Q4_0, Q4_1, Q4_K; Q8_0, Q5_0, Q5_1 and Q5_K split into two nibbles) as ``w = scale * (q - 8) + zero``, the form
torch's int4 weight-packed matmuls take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30
FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
#: ggml type -> (values per block, bytes per block)
BLOCK_SIZES = {
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
    IQ4_NL: (32, 18), IQ4_XS: (256, 136),
}
TYPE_NAMES = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
    Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS",
}
#: IQ4_NL's and IQ4_XS's 16 non-linear values, indexed by a 4-bit code
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: formats ``int4_groups`` maps onto 4-bit codes in groups of 32
INT4_GROUP_TYPES = (Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K)
#: formats whose codes are wider than 4 bits: two nibbles, the row twice as wide
SPLIT_TYPES = (Q8_0, Q5_0, Q5_1, Q5_K)
GROUP_SIZE = 32


@dataclass(slots=True)
class GGUFBlocks:
    """One quantized matrix ``[rows, cols]`` as its raw blocks ``uint8 [rows, row_bytes]``."""

    ggml_type: int
    rows: int
    cols: int
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))

    def select_rows(self, index: torch.Tensor | slice) -> GGUFBlocks:
        """The blocks of some rows (a slice or an index tensor), still quantized."""
        data = self.data[index]
        return GGUFBlocks(self.ggml_type, data.shape[0], self.cols, data)


def stack_rows(parts: list[GGUFBlocks]) -> GGUFBlocks:
    """Parts of one type stacked along rows (fused q/k/v, gate/up)."""
    first = parts[0]
    if any(p.ggml_type != first.ggml_type or p.cols != first.cols for p in parts):
        raise ValueError("only blocks of one type and width stack")
    data = torch.cat([p.data for p in parts])
    return GGUFBlocks(first.ggml_type, data.shape[0], first.cols, data)


def is_supported(ggml_type: int) -> bool:
    return ggml_type in BLOCK_SIZES or ggml_type in FLOAT_TYPES


def _blocks(blocks: GGUFBlocks) -> torch.Tensor:
    # [rows, num_blocks, block_bytes]
    values, nbytes = BLOCK_SIZES[blocks.ggml_type]
    return blocks.data.reshape(blocks.rows, blocks.cols // values, nbytes)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # [..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, [..., 8] each
    s = scales.to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def _q4_k_codes(qs: torch.Tensor) -> torch.Tensor:
    # [..., 128] -> [..., 256] codes 0..15: each 32 bytes hold 64 values, low nibbles first
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).reshape(*qs.shape[:-1], 256)


def _decode(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes [rows, nb, values], scale [rows, nb, groups], offset or None)`` with
    ``w = scale * codes + offset`` per group of ``values / groups``."""
    b = _blocks(blocks)
    kind = blocks.ggml_type
    if kind == Q4_0:
        return _nibbles(b[..., 2:]).float() - 8, _f16(b[..., 0:2])[..., None], None
    if kind == Q4_1:
        return _nibbles(b[..., 4:]).float(), _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    if kind == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).float(), _f16(b[..., 0:2])[..., None], None
    if kind in (Q5_0, Q5_1):  # [d][m (Q5_1)][qh: bit v of the 32-bit word is value v's fifth bit][qs]
        minimum = 2 if kind == Q5_1 else 0
        qh = b[..., 2 + minimum : 6 + minimum].to(torch.int32)
        shifts = torch.arange(8, dtype=torch.int32, device=b.device)
        fifth = ((qh[..., None] >> shifts) & 1).reshape(*qh.shape[:-1], 32)
        codes = (_nibbles(b[..., 6 + minimum :]).to(torch.int32) | (fifth << 4)).float()
        if kind == Q5_0:
            return codes - 16, _f16(b[..., 0:2])[..., None], None
        return codes, _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    if kind in (IQ4_NL, IQ4_XS):  # 4-bit codes index IQ4_VALUES: w = d t[q] (IQ4_XS: d (s - 32) t[q] per 32 values)
        table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=b.device)
        if kind == IQ4_NL:
            return table[_nibbles(b[..., 2:18]).long()], _f16(b[..., 0:2])[..., None], None
        codes = _nibbles(b[..., 8:136].reshape(*b.shape[:-1], 8, 16)).reshape(*b.shape[:-1], 256)
        high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)
        shifts = torch.arange(8, device=b.device)
        low = torch.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], -1).reshape(*b.shape[:-1], 8).to(torch.int32)
        scales = (low | (((high[..., None] >> (2 * shifts)) & 3) << 4)) - 32
        return table[codes.long()], _f16(b[..., 0:2])[..., None] * scales.float(), None
    if kind in (Q2_K, Q3_K):  # two bits a value: bits 2j of byte l of half n are value 128 n + 32 j + l
        qs = b[..., 16:80] if kind == Q2_K else b[..., 32:96]
        shifts = 2 * torch.arange(4, dtype=torch.uint8, device=b.device)
        codes = ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts[:, None]) & 3).reshape(*qs.shape[:-1], 256).to(torch.int32)
        if kind == Q2_K:  # [scales: scale | min << 4 per 16 values][qs][d][dmin]
            scales = b[..., 0:16].to(torch.int32)
            d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
            return codes.float(), d * (scales & 0x0F).float(), -dmin * (scales >> 4).float()
        # Q3_K [hmask: bit 4 n + j of byte l][qs][12 bytes of 6-bit scales][d]: w = d (s - 32) (q - 4)
        hmask = b[..., 0:32].to(torch.int32)
        high = torch.stack([(hmask >> bit) & 1 for bit in range(8)], dim=-2).reshape(*hmask.shape[:-1], 256)
        raw = b[..., 96:108].to(torch.int32)
        low, mid, top = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
        six = torch.cat([(low & 15) | ((top & 3) << 4), (mid & 15) | (((top >> 2) & 3) << 4),
                         (low >> 4) | (((top >> 4) & 3) << 4), (mid >> 4) | (((top >> 6) & 3) << 4)], -1)
        return (codes | (high << 2)).float() - 4, _f16(b[..., 108:110])[..., None] * (six - 32).float(), None
    if kind in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, m = _k_scales(b[..., 4:16])
        codes = _q4_k_codes(b[..., -128:]).float()
        if kind == Q5_K:
            qh = b[..., 16:48].to(torch.int32)  # bit j of qh[l]: value 32 j + l gets +16
            bits = torch.stack([(qh >> j) & 1 for j in range(8)], dim=-2).reshape(*qh.shape[:-1], 256)
            codes = codes + 16 * bits.float()
        return codes, d * sc, -dmin * m
    if kind == Q6_K:
        ql, qh = b[..., 0:128].to(torch.int32), b[..., 128:192].to(torch.int32)
        scales, d = b[..., 192:208].contiguous().view(torch.int8).float(), _f16(b[..., 208:210])[..., None]
        halves = []
        for n in range(2):
            low, high = ql[..., 64 * n : 64 * n + 64], qh[..., 32 * n : 32 * n + 32]
            nib = torch.cat([low & 0x0F, low >> 4], -1)  # values 0..63, 64..127 of the half (low part)
            top = torch.cat([high & 3, (high >> 2) & 3, (high >> 4) & 3, (high >> 6) & 3], -1)
            halves.append((nib | (top << 4)) - 32)
        return torch.cat(halves, -1).float(), d * scales, None
    raise ValueError(f"GGUF type {blocks.type_name} is not one Sonar decodes")


def _dequantize_32(blocks: GGUFBlocks) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q8_0 (one scale per block of 32) decoded in place into one float32 buffer:
    the same values as the general path in a few passes over the matrix."""
    b = _blocks(blocks)
    kind = blocks.ggml_type
    out = torch.empty(*b.shape[:2], GROUP_SIZE, dtype=torch.float32, device=b.device)  # [rows, nb, 32]
    scale = _f16(b[..., 0:2])[..., None]
    if kind == Q8_0:
        out.copy_(b[..., 2:].contiguous().view(torch.int8))
        return out.mul_(scale).view(blocks.rows, blocks.cols)
    qs = b[..., 4:] if kind == Q4_1 else b[..., 2:]
    half = GROUP_SIZE // 2
    out[..., :half].copy_(qs & 0x0F)  # low nibbles are the block's first 16 values
    out[..., half:].copy_(qs >> 4)
    if kind == Q4_0:
        return out.sub_(8).mul_(scale).view(blocks.rows, blocks.cols)
    return out.mul_(scale).add_(_f16(b[..., 2:4])[..., None]).view(blocks.rows, blocks.cols)


def dequantize_blocks(blocks: GGUFBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix ``[rows, cols]`` in ``dtype`` (computed in float32, as llama.cpp's reference)."""
    if blocks.ggml_type in (Q4_0, Q4_1, Q8_0):
        return _dequantize_32(blocks).to(dtype)
    codes, scale, offset = _decode(blocks)
    groups = scale.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], groups, -1) * scale[..., None]
    if offset is not None:
        grouped = grouped + offset[..., None]
    return grouped.reshape(blocks.rows, blocks.cols).to(dtype)


def int4_groups(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [rows, width] in 0..15, scale [rows, width / 32], zero [rows, width / 32])``
    with ``w = scale * (codes - 8) + zero`` per group of 32 along the row.

    ``width`` is ``cols`` for the 4-bit formats. A wider code ``c = 16 h + l`` (Q8_0's signed
    8 bits, Q5_K's 5) becomes two nibbles: ``h + 8`` with scale ``16 s`` and zero 0, then ``l``
    with scale ``s`` and zero ``8 s + offset``; the row is twice as wide and the input must be
    repeated to match (``x`` then ``x``).
    """
    kind = blocks.ggml_type
    if kind not in INT4_GROUP_TYPES:
        raise ValueError(f"GGUF type {blocks.type_name} has no 4-bit group form")
    codes, scale, offset = _decode(blocks)
    rows = blocks.rows
    # one scale per group of 32: [rows, nb, groups]
    scale = scale.reshape(rows, -1)
    offset = torch.zeros_like(scale) if offset is None else offset.reshape(rows, -1)
    codes = codes.reshape(rows, -1).to(torch.int32)
    if kind in SPLIT_TYPES:
        high, low = (codes >> 4) + 8, codes & 0x0F
        codes4 = torch.cat([high, low], dim=1)
        return codes4.to(torch.uint8), torch.cat([16 * scale, scale], 1), torch.cat([torch.zeros_like(scale), 8 * scale + offset], 1)
    if kind == Q4_0:
        return (codes + 8).to(torch.uint8), scale, offset  # decoded codes were shifted to -8..7
    return codes.to(torch.uint8), scale, 8 * scale + offset
