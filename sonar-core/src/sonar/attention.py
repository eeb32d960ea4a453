"""The attention-backend interface over the paged KV cache.

The model runner lays out one step's tokens sequence by sequence, **decodes first**: the first
``num_decodes`` sequences have exactly one new token each, the rest are prefill chunks (new
tokens appended after an already-cached context, which may come from the prefix cache or an
earlier chunk). Each layer's KV cache is one tensor
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values); token ``i``
of the step is written to flat slot ``slot_mapping[i]`` = ``block_id * block_size + offset``.

An FP8 cache stores ``key / k_scale`` and ``value / v_scale``, saturated to the format's largest
finite value (see ``quantize_for_cache``): ``kv_cache_dtype="fp8"`` (``torch.float8_e4m3fn``,
+-448) with the layer's scales from the checkpoint, ``"fp8_e5m2"`` (``torch.float8_e5m2``,
+-57344) with scales of 1.0 (the model runner sets them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


# the FP8 formats a KV cache may hold -> their largest finite value
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of ``dtype`` holds scaled FP8 values."""
    return dtype in FP8_MAX


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` stores it: ``x / scale`` saturated to the FP8 range
    and rounded to nearest for an FP8 cache, a plain cast (``scale`` unused) otherwise."""
    fp8_max = FP8_MAX.get(cache_dtype)
    if fp8_max is None:
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp_(-fp8_max, fp8_max).to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values back in ``dtype``: times ``scale`` for an FP8 cache, a plain cast otherwise."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer."""

    num_decodes: int  # sequences [0, num_decodes) have query_len == 1
    num_decode_tokens: int  # == num_decodes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_seqs] int32, device: context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, device (padded with 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, for backends that loop over prefills
    seq_lens_cpu: list[int]
    extra: Any = None  # backend-specific precomputed state (built by prepare_metadata)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass(slots=True)
class ForwardContext:
    """What a model's attention layers need for one step, passed explicitly down the forward."""

    attn_metadata: AttentionMetadata | None  # None: no KV cache (profiling / plain forward)
    kv_caches: list[torch.Tensor]  # one per layer
    kv_connector: Any = None  # the worker half of a KV connector whose per-layer hooks run (or None)


class AttentionBackend:
    """Paged attention for one layer shape. A platform names its subclass in
    ``Platform.attention_backend_cls``.

    One instance serves every layer of a model with the same shape; the layer passes its own
    KV-cache tensor in.

    :param scale: the factor of ``q . k`` (``head_dim ** -0.5`` for most models).
    :param sliding_window: a token attends to the last ``sliding_window`` positions only (itself
        included); None: to its whole sequence.
    :param logit_softcap: a cap ``c`` on attention scores (Gemma 2's ``attn_logit_softcapping``):
        each scaled score ``s`` becomes ``c * tanh(s / c)`` before the mask and the softmax;
        None: scores are used as they are. A backend that cannot apply it refuses it here
        (the engine builds backends with it only for models that set a cap).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        """Precompute backend state for a step (stored in ``metadata.extra``); once per step."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write ``key``/``value`` into the cache at ``slot_mapping``, then attend each new token
        causally over its sequence's cached context plus the new tokens before it.

        ``k_scale`` / ``v_scale``: the layer's scales of an FP8 cache (ignored by other caches)."""
        raise NotImplementedError


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """A slow, obviously-correct paged attention in float32, for tests (any cache dtype); the
    arguments as ``AttentionBackend``'s."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k[metadata.slot_mapping] = quantize_for_cache(key, flat_k.dtype, k_scale)
    flat_v[metadata.slot_mapping] = quantize_for_cache(value, flat_v.dtype, v_scale)
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    for i in range(metadata.num_seqs):
        start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
        seq_len = metadata.seq_lens_cpu[i]
        q_len = end - start
        num_blocks_used = (seq_len + block_size - 1) // block_size
        blocks = metadata.block_tables[i, :num_blocks_used].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()[:seq_len]
        k = dequantize_from_cache(flat_k[slots], torch.float32, k_scale).repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
        v = dequantize_from_cache(flat_v[slots], torch.float32, v_scale).repeat_interleave(group, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = key_pos > q_pos[:, None]
        if sliding_window is not None:
            mask |= key_pos <= q_pos[:, None] - sliding_window
        scores.masked_fill_(mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out
