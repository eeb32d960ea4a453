"""Matrix-vector product for one row of activations: ``y = W x (+ b)``.

Decode at batch 1 reads every weight once per token, so its speed is the rate at which the
weights stream from memory. One program per output row reads the whole row in chunks of
``BLOCK_K`` that are all issued before any is summed (the chunk loop is unrolled), with the
weight marked evict-first so it does not push the activations out of L2.

Measured on an H200 (bf16, Llama-3.1-8B's projections, cold weights, in a CUDA graph):
qkv 6144 x 4096 13.1 us (cuBLAS 15.6), o 4096 x 4096 9.3 us (cuBLAS 12.7 with its split-K
reduction), gate_up 28672 x 4096 53.7 us (57.0), down 4096 x 14336 28.6 us (31.1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_UNROLLED_K = 32768  # longer rows would unroll too many chunks: left to the library
# rows shorter than this many bytes and more rows than MAX_SHORT_ROWS: left to the library (a
# program per short row is too little work each; Qwen3-0.6B's 151936 x 1024 head took 95 us
# here against the library's 78 us, while its 6144 x 1024 projection took 5.5 us against 6.0)
MIN_ROW_BYTES = 4096
MAX_SHORT_ROWS = 16384


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    stride_w,
    a_ptr,
    slots_ptr,
    shrunk_ptr,
    num_rows,
    num_slots,
    stride_as,
    stride_an,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SHRINK: tl.constexpr,
):
    row = tl.program_id(0)
    w_row = w_ptr + row.to(tl.int64) * stride_w
    if SHRINK:  # the programs past the weight's rows take the adapter's A rows of the token's slot
        slot = tl.load(slots_ptr)
        valid = (slot >= 0) & (slot < num_slots)
        a_row = a_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_as + (row - num_rows).to(tl.int64) * stride_an
        w_row = tl.where(row >= num_rows, a_row, w_row)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            w = tl.load(w_row + start + cols, eviction_policy="evict_first")
            x = tl.load(x_ptr + start + cols)
        else:
            mask = start + cols < K
            w = tl.load(w_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + start + cols, mask=mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    y = tl.sum(acc, 0)
    if SHRINK:
        if row >= num_rows:  # float32, zero for a token without a slot
            tl.store(shrunk_ptr + (row - num_rows), tl.where(valid, y, 0.0))
            return
    if HAS_BIAS:
        y += tl.load(bias_ptr + row).to(tl.float32)
    tl.store(y_ptr + row, y.to(y_ptr.dtype.element_ty))


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`gemv` computes this product: one row of ``x``, both operands (and the
    bias) of one floating dtype, the weight's rows and ``x`` contiguous."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.numel() != weight.shape[1]:
        return False
    if x.dtype != weight.dtype or not x.dtype.is_floating_point or weight.shape[1] > MAX_UNROLLED_K:
        return False
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return False
    return weight.stride(1) == 1 and x.stride(-1) == 1 and x.device == weight.device


def gemv_pays(weight: torch.Tensor) -> bool:
    """Whether the weight's rows are long enough, or few enough, for a program per row to beat
    the library."""
    return weight.shape[1] * weight.element_size() >= MIN_ROW_BYTES or weight.shape[0] <= MAX_SHORT_ROWS


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` holding one row (shape ``[..., K]`` with one row in
    all), accumulated in float32, returned in ``x``'s dtype with shape ``[..., N]``."""
    assert gemv_supported(x, weight, bias), "gemv takes one contiguous row and a row-major weight of its dtype"
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    _launch(x, weight, bias, y)
    return y


def gemv_with_shrink(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gemv` and a LoRA shrink of the same row in one launch: ``(x @ weight.T (+ bias),
    x @ a[slot].T)`` with ``slot = token_slots[0]`` (read on the device), the second float32
    ``[1, N]`` and zero where the slot is outside ``[0, S)``. ``a [S, N, K]`` adds ``N``
    programs to the weight's rows (a few dozen, next to thousands), so the shrink costs no
    launch of its own and no split: decode at batch 1 with an adapter."""
    assert gemv_supported(x, weight, bias), "gemv takes one contiguous row and a row-major weight of its dtype"
    assert a.dim() == 3 and a.shape[2] == weight.shape[1] and a.dtype == weight.dtype and a.stride(2) == 1
    assert token_slots.numel() >= 1 and token_slots.dtype in (torch.int32, torch.int64)
    y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    shrunk = torch.empty(1, a.shape[1], dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, y, (a, token_slots, shrunk))
    return y, shrunk


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
    shrink: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    n, k = weight.shape
    a, slots, shrunk = shrink if shrink is not None else (weight.unsqueeze(0), y, y)
    extra = a.shape[1] if shrink is not None else 0
    if n + extra == 0:
        return
    block_k = min(2048, triton.next_power_of_2(max(k, 1)))
    _gemv_kernel[(n + extra,)](
        x, weight, bias if bias is not None else weight, y, weight.stride(0),
        a, slots, shrunk, n, a.shape[0], a.stride(0), a.stride(1),
        K=k, BLOCK_K=block_k, HAS_BIAS=bias is not None, SHRINK=shrink is not None,
        num_warps=max(1, min(8 if k <= 4096 else 4, block_k // 256)),
    )  # fmt: skip


def reference_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain float32 torch version of :func:`gemv` (returns float32)."""
    y = x.float() @ weight.float().t()
    return y if bias is None else y + bias.float()
