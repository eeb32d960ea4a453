"""Row-wise argmax over a wide last dimension (greedy sampling over the vocabulary).

A single row of 128k logits is one output for a library reduction, which then runs on few
multiprocessors (28 us on an H200). Here the row is cut into blocks: each program finds its
block's maximum, and a second launch picks the first block holding the row's maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _block_argmax_kernel(x_ptr, values_ptr, indices_ptr, n_cols, stride_row, num_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    value, index = _first_max(x)
    slot = row * num_blocks + block
    tl.store(values_ptr + slot, value)
    tl.store(indices_ptr + slot, block * BLOCK + index)


@triton.jit
def _first_max(x):
    """The largest value of ``x`` and its first index; a NaN counts as the largest (as in torch)."""
    is_nan = (x != x).to(tl.int32)
    value, index = tl.max(tl.where(is_nan != 0, float("-inf"), x), 0, return_indices=True, return_indices_tie_break_left=True)
    first_nan = tl.argmax(is_nan, 0, tie_break_left=True)
    has_nan = tl.max(is_nan, 0) != 0
    return tl.where(has_nan, float("nan"), value), tl.where(has_nan, first_nan, index)


@triton.jit
def _pick_block_kernel(values_ptr, indices_ptr, out_ptr, num_blocks, BLOCKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    blocks = tl.arange(0, BLOCKS_PAD)
    mask = blocks < num_blocks
    values = tl.load(values_ptr + row * num_blocks + blocks, mask=mask, other=float("-inf"))
    _, best = _first_max(values)
    tl.store(out_ptr + row, tl.load(indices_ptr + row * num_blocks + best).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x`` ``[B, V]`` with a contiguous last dimension: ``[B]`` int64,
    the first index on ties."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, n_cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_blocks = triton.cdiv(n_cols, BLOCK)
    values = torch.empty(rows, num_blocks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, num_blocks, dtype=torch.int32, device=x.device)
    _block_argmax_kernel[(rows, num_blocks)](x, values, indices, n_cols, x.stride(0), num_blocks, BLOCK=BLOCK, num_warps=4)
    _pick_block_kernel[(rows,)](values, indices, out, num_blocks, BLOCKS_PAD=max(2, triton.next_power_of_2(num_blocks)), num_warps=1)
    return out
