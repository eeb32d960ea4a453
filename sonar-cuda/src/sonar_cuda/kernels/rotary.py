"""Rotary position embedding, neox style (rotate the two halves of each head), in place on the
query and key of one step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # x1, x2: [BLOCK_H, BLOCK_HALF], the first and second halves of the rotated dims
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first = x_ptr + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_sin_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # cos_sin row: [cos(HALF), sin(HALF)]
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * stride_cos_sin_position + dims
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_q_token, stride_q_head, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, token, stride_k_token, stride_k_head, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos in the first half, sin in the second
) -> None:
    """Rotate the first ``rotary_dim`` dims of every query and key head in place, neox style:
    ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin`` with ``x1, x2`` the two halves, computed
    in float32. ``query``/``key`` may be strided views with a contiguous last dimension."""
    num_tokens, num_q_heads, _ = query.shape
    num_k_heads = key.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    if num_tokens == 0:
        return
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert rotary_dim % 2 == 0 and rotary_dim <= query.shape[2]
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=rotary_dim // 2,
        BLOCK_QH=triton.next_power_of_2(max(num_q_heads, 1)),  # no query heads: keys alone
        BLOCK_KH=triton.next_power_of_2(max(num_k_heads, 1)),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        num_warps=4,
    )


def build_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The plain (unscaled) rope table ``[max_position, rotary_dim]`` in float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def reference_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float32 torch version of :func:`rotary_embedding`; returns new float32 tensors."""
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [num_tokens, 1, half]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clone()
        x1, x2 = x[..., :half].clone(), x[..., half:rotary_dim].clone()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half:rotary_dim] = x2 * cos + x1 * sin
        return x

    return rotate(query), rotate(key)
