"""Matrices quantized to 4-bit codes in groups of 32, run by torch's int4 weight-packed CPU matmul.

A weight is ``w = scale * (code - 8) + zero`` per group of 32 along its input dimension.
``torch._weight_int4pack_mm_for_cpu`` computes ``x @ w.T`` from the packed codes without
building ``w``; on CPUs without AVX-512 only its bfloat16 path is fast, so inputs, scales and
zeros run in bfloat16 and the output returns in the input's dtype.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16
INNER_K_TILES = 2  # the packing layout the CPU kernel reads


def pack_int4_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` uint8 ``[N, K]`` in 0..15, ``scales``/``zeros`` ``[N, K / 32]`` ->
    ``(packed uint8 [N, K / 2], scales_and_zeros [K / 32, N, 2])`` for :func:`int4_group_linear`."""
    if codes.shape[1] % GROUP_SIZE:
        raise ValueError(f"the input dimension {codes.shape[1]} is not a multiple of {GROUP_SIZE}")
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), INNER_K_TILES)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
    return packed, scales_and_zeros


def int4_group_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, input_repeats: int = 1) -> torch.Tensor:
    """``x [..., K] @ w.T`` for a weight packed by :func:`pack_int4_groups` whose rows are
    ``input_repeats`` copies of the input wide (a code split in two nibbles reads ``x`` twice)."""
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
    if input_repeats > 1:
        flat = flat.repeat(1, input_repeats)
    out = torch._weight_int4pack_mm_for_cpu(flat, packed, GROUP_SIZE, scales_and_zeros)
    return out.to(x.dtype).reshape(*leading, out.shape[-1])
