"""KV-cache write: each new token's key and value go to its flat slot in the paged cache.

An FP8 cache stores ``key / k_scale`` and ``value / v_scale``, saturated to the format's range
(``torch.float8_e4m3fn``: +-448; ``torch.float8_e5m2``: +-57344) and rounded to nearest even;
other caches store a plain cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.attention import is_fp8, quantize_for_cache

@triton.jit
def _to_fp8_e4m3(x, inv_scale):
    """``x * inv_scale`` saturated to +-448 (E4M3's largest finite value) and rounded to E4M3's
    3 mantissa bits (nearest, ties to even) in float32, so the final conversion is exact
    whichever way a backend rounds."""
    x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    return bits.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _to_fp8_e5m2(x, inv_scale):
    """``x * inv_scale`` saturated to +-57344 (E5M2's largest finite value) and rounded to
    E5M2's 2 mantissa bits as ``_to_fp8_e4m3`` rounds to E4M3's 3."""
    x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -57344.0), 57344.0)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000
    return bits.to(tl.float32, bitcast=True).to(tl.float8e5)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the cache is FP8: quantize with the scales
    E5M2: tl.constexpr,  # ... to float8_e5m2 (else float8_e4m3fn)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch larger than the real one)
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # [BLOCK_H, BLOCK_D]
    src_key = key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
    src_value = value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    dst = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(src_key, mask=mask)
    v = tl.load(src_value, mask=mask)
    if FP8:
        if E5M2:
            k = _to_fp8_e5m2(k, inv_k_scale)
            v = _to_fp8_e5m2(v, inv_v_scale)
        else:
            k = _to_fp8_e4m3(k, inv_k_scale)
            v = _to_fp8_e4m3(v, inv_v_scale)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative slots are skipped
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``i``'s key and value to flat slot ``slot_mapping[i]`` of the caches, in place.

    ``key``/``value`` may be strided views (of a fused qkv projection) as long as the last
    dimension is contiguous; the caches must be contiguous per slot. An FP8 cache stores
    ``key / k_scale`` and ``value / v_scale`` (the scales are unused otherwise).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need a contiguous last dimension"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "cache blocks must be contiguous"
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8(k_cache.dtype),
        E5M2=k_cache.dtype == torch.float8_e5m2,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def reference_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain torch version of :func:`reshape_and_cache`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = quantize_for_cache(key[keep], k_cache.dtype, k_scale)
    flat_v[slots] = quantize_for_cache(value[keep], v_cache.dtype, v_scale)
