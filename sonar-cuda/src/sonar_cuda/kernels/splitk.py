"""Split-K for skinny products: programs that each sum one slice of the inputs write float32
partial rows ``[SPLIT_K, M, N]``; one short launch adds the slices (and the bias) and rounds
to the output dtype. Used where a product has too few output rows to give every
multiprocessor work (Llama-3.1-8B's o and down projections at batch 1).

:func:`choose_split` picks the factor from the program count: enough programs for about
``WAVES`` per multiprocessor, never a slice shorter than ``min_slice`` runs of inputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

WAVES = 2
MAX_SPLIT = 16
REDUCE_BLOCK = 1024


@triton.jit
def _sum_splits_kernel(
    part_ptr, bias_ptr, y_ptr, MN, N,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + split * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` ``[M, N]`` (contiguous) = ``partials.sum(0) (+ bias)`` rounded to ``out``'s dtype,
    for float32 ``partials`` ``[SPLIT_K, M, N]``."""
    split_k, m, n = partials.shape
    _sum_splits_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
        partials, bias if bias is not None else partials, out, m * n, n,
        SPLIT_K=split_k, BLOCK=REDUCE_BLOCK, HAS_BIAS=bias is not None, num_warps=4,
    )  # fmt: skip
    return out


def choose_split(num_programs: int, num_runs: int, num_sms: int, min_slice: int = 4) -> int:
    """The split-K factor for ``num_programs`` output tiles over ``num_runs`` runs of inputs:
    a power of two up to ``MAX_SPLIT`` that brings the programs to ``WAVES * num_sms``, each
    slice at least ``min_slice`` runs; 1 where the tiles alone fill the GPU."""
    split = 1
    while split < MAX_SPLIT and num_programs * split < WAVES * num_sms and num_runs // (split * 2) >= min_slice:
        split *= 2
    return split


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (an H200's 132 where there is no GPU: the interpreter)."""
    if device.type != "cuda":
        return 132
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
