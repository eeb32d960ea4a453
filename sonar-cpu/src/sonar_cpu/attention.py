"""Paged attention on the CPU: Sonar's C kernel for float32 decodes, PyTorch's
scaled_dot_product_attention otherwise.

With a float32 cache and queries, where Sonar's C kernels are built (``sonar_cpu.native``), the
new tokens' keys and values are written by one C call and every decode of the step is attended
by another, reading its blocks in place through the block table (``csrc/decode_attention.c``);
so are the tokens of short chunks over a cached context (a verify step's drafts), one decode
row per token (``attention_plan.SHORT_CHUNK_TOKENS``); longer prefill chunks still go to SDPA as
below.

Otherwise, per layer and step: one ``index_copy_`` per K and V writes the new tokens into the cache; the
decodes are attended in a few batched calls over their blocks gathered from the cache (grouped
by length and sized to stay in the CPU's caches, see ``attention_plan``); each prefill chunk is
one call. Grouped-query attention never repeats K/V: a decode's query heads are laid out as
``[kv_heads, group]`` so that each KV head serves its group as a short query block.

An FP8 cache (E4M3 or E5M2) stores ``key / k_scale`` and ``value / v_scale``; the scales are
folded into the attention (``k_scale`` into the softmax scale, ``v_scale`` into the output), so
dequantizing is only the cast to the compute dtype that every cache dtype already pays.

A layer with a cap on its scores (``logit_softcap``, Gemma 2) has them capped in the C kernel,
and where SDPA would run, its calls are written out (scores, cap, mask, softmax): SDPA has no
cap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonar.attention import AttentionBackend, AttentionMetadata, is_fp8, quantize_for_cache

from sonar_cpu import native
from sonar_cpu.attention_plan import BUCKET_CALL_COST_TOKENS, CpuAttentionPlan, DecodeBucket, DecodeRows, PrefillChunk, build_plan

#: Without AMX, PyTorch's half-precision flash kernel converts to float32 block by block and runs
#: compute-bound prefills at about half the float32 speed; decodes are memory-bound and stay in
#: the cache's dtype.
UPCAST_HALF_PREFILL = "AMX" not in torch.backends.cpu.get_cpu_capability()


class CpuAttentionBackend(AttentionBackend):
    """Attention over the paged KV cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    for float32, bfloat16, float16 and scaled FP8 E4M3 or E5M2 (the cache may hold another dtype
    than the activations)."""

    #: The cost of one more decode call, in gathered tokens, when grouping decodes by length.
    bucket_call_cost_tokens: int = BUCKET_CALL_COST_TOKENS

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        # reused by every gather: a fresh multi-MB tensor per call costs more than the gather
        self._workspace: torch.Tensor | None = None

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        """Group the decodes into length buckets and describe the prefill chunks, once per step."""
        metadata.extra = build_plan(metadata, cls.bucket_call_cost_tokens)

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
        """Write ``key``/``value`` at ``slot_mapping``, then attend each new token causally over its
        sequence's cached context and the new tokens up to itself (``k_scale`` / ``v_scale``:
        the layer's FP8 scales, ignored by other caches)."""
        if not isinstance(metadata.extra, CpuAttentionPlan):
            self.prepare_metadata(metadata)
        plan: CpuAttentionPlan = metadata.extra
        library = native_library(query, kv_cache)
        plan.bind(kv_cache, metadata, decode_buckets=library is None)

        if library is not None and _rows_contiguous(key, value):
            slots = metadata.slot_mapping.contiguous()
            library.write_kv(
                key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), kv_cache.data_ptr(),
                kv_cache.shape[1] * kv_cache.shape[2], self.num_kv_heads * self.head_dim, slots.data_ptr(), slots.numel(),
            )
            return self._attend(query, key, value, kv_cache, metadata, plan, (1.0, 1.0), library)

        # cache write: [2, num_blocks * block_size, num_kv_heads, head_dim]
        flat_cache = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        fp8 = is_fp8(kv_cache.dtype)
        key, value = quantize_for_cache(key, kv_cache.dtype, k_scale), quantize_for_cache(value, kv_cache.dtype, v_scale)
        if fp8:  # torch has no FP8 index_copy_ on the CPU: copy the bytes
            flat_cache, key_rows, value_rows = flat_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
        else:
            key_rows, value_rows = key, value
        flat_cache[0].index_copy_(0, metadata.slot_mapping, key_rows)
        flat_cache[1].index_copy_(0, metadata.slot_mapping, value_rows)
        scales = (k_scale, v_scale) if fp8 else (1.0, 1.0)
        return self._attend(query, key, value, kv_cache, metadata, plan, scales, library)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: CpuAttentionPlan,
        scales: tuple[float, float],
        library,
    ) -> torch.Tensor:
        """Attend the step's tokens over the cache holding them: the decodes (and the tokens of
        short chunks) in one C call where ``library`` is given, else the decodes in the plan's
        batched calls; each remaining prefill chunk in one call."""
        prefills = plan.prefills
        if library is not None:
            rows = plan.decode_rows
            prefills = rows.prefills
            decoded = self._native_decode(library, query[rows.query_rows], kv_cache, rows) if rows.num_rows else None
            if decoded is not None and isinstance(rows.query_rows, slice) and rows.num_rows == query.shape[0]:
                return decoded  # every token a decode row, in order
            out = torch.empty_like(query)
            if decoded is not None:
                out[rows.query_rows] = decoded
        elif not prefills and len(plan.decode_buckets) == 1:
            return self._decode(query, kv_cache, plan, plan.decode_buckets[0], scales)
        else:
            out = torch.empty_like(query)
            decode_out = out[: metadata.num_decodes]
            for bucket in plan.decode_buckets:
                decode_out[bucket.rows] = self._decode(query[: metadata.num_decodes][bucket.rows], kv_cache, plan, bucket, scales)
        for chunk in prefills:
            out[chunk.start : chunk.end] = self._prefill(query, key, value, kv_cache, plan, chunk, scales)
        return out

    def _native_decode(self, library, query: torch.Tensor, kv_cache: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
        """Every decode row of the step (``query``: theirs) in one call of the C kernel
        (float32 query and cache)."""
        n = rows.num_rows
        decode_query = query.contiguous()
        out = torch.empty_like(decode_query)
        tables, seq_lens = rows.block_tables, rows.seq_lens
        code = library.paged_decode_attention(
            decode_query.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2], self.num_kv_heads,
            self.head_dim, self.num_heads, tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), n,
            self.sliding_window or 0, self.scale, self.logit_softcap or 0.0, out.data_ptr(), torch.get_num_threads(),
        )
        if code:
            raise RuntimeError(f"the C decode attention failed (code {code}) for {self.num_heads} heads over {self.num_kv_heads} KV heads")
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: CpuAttentionPlan,
        bucket: DecodeBucket,
        scales: tuple[float, float],
    ) -> torch.Tensor:  # [n, num_heads, head_dim]
        n = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        if bucket.first_block is not None:  # consecutive blocks: the cache itself, no copy
            blocks = kv_cache[:, bucket.first_block : bucket.first_block + bucket.num_blocks]
            gathered = blocks.reshape(2, 1, -1, self.num_kv_heads, self.head_dim)
        else:  # gather: [2, n, padded_len, num_kv_heads, head_dim]
            gathered = self._gather(kv_cache, bucket.gather_ids).view(2, n, -1, self.num_kv_heads, self.head_dim)
        if bucket.single_len is not None:  # one sequence: only its tokens, nothing to mask
            start, end = bucket.attended_span(self.sliding_window)
            gathered, mask = gathered[:, :, start:end], None
        else:
            mask = plan.decode_mask(bucket, self.sliding_window, query.dtype)
        gathered = gathered.to(query.dtype)
        keys = gathered[0].transpose(1, 2)  # [n, num_kv_heads, padded_len, head_dim]
        values = gathered[1].transpose(1, 2)
        grouped_query = query.view(n, self.num_kv_heads, group, self.head_dim)
        k_scale, v_scale = scales
        out = self._sdpa(grouped_query, keys, values, mask, self.scale * k_scale)
        return _times(out, v_scale).view(n, self.num_heads, self.head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: CpuAttentionPlan,
        chunk: PrefillChunk,
        scales: tuple[float, float],
    ) -> torch.Tensor:  # [q_len, num_heads, head_dim]
        k_scale, v_scale = scales
        compute_dtype = torch.float32 if UPCAST_HALF_PREFILL and query.element_size() == 2 else query.dtype
        q = query[chunk.start : chunk.end].transpose(0, 1).to(compute_dtype)  # [num_heads, q_len, head_dim]
        if chunk.context_len == 0:
            # a first chunk attends only to itself: no gather (new k/v as stored in the cache)
            keys = key[chunk.start : chunk.end].transpose(0, 1).to(compute_dtype)
            values = value[chunk.start : chunk.end].transpose(0, 1).to(compute_dtype)
            if self.sliding_window is None and self.logit_softcap is None:
                # 4-d inputs: PyTorch's CPU flash kernel takes only those (3-d falls back to the
                # math path, about 10x slower)
                out = F.scaled_dot_product_attention(
                    q[None], keys[None], values[None], is_causal=True, scale=self.scale * k_scale, enable_gqa=True
                )
                return _times(out[0].transpose(0, 1), v_scale)
        else:
            # [2, seq_len, num_kv_heads, head_dim] from the cache, new tokens included
            gathered = self._gather(kv_cache, chunk.gather_ids).view(2, -1, self.num_kv_heads, self.head_dim)
            gathered = gathered[:, : chunk.seq_len].to(compute_dtype)
            keys, values = gathered[0].transpose(0, 1), gathered[1].transpose(0, 1)
        mask = plan.prefill_mask(chunk, self.sliding_window, compute_dtype, query.device)
        if self.logit_softcap is not None:  # the query heads of a KV head side by side, as a decode's
            group = self.num_heads // self.num_kv_heads
            grouped = q.reshape(self.num_kv_heads, group * q.shape[1], self.head_dim)
            out = self._sdpa(grouped, keys, values, mask.repeat(group, 1), self.scale * k_scale)
            return _times(out.view(self.num_heads, -1, self.head_dim).transpose(0, 1), v_scale)
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=self.scale * k_scale, enable_gqa=True
        )
        return _times(out[0].transpose(0, 1), v_scale)

    def _sdpa(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """SDPA over ``query [..., q, d]`` and ``keys``/``values [..., k, d]`` (the same leading
        dims) with an additive ``mask`` broadcast to ``[..., q, k]``; written out where the
        layer caps its scores."""
        cap = self.logit_softcap
        if cap is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scale / cap).tanh_().mul_(cap)
        if mask is not None:
            scores.add_(mask)
        return torch.matmul(scores.softmax(dim=-1), values)

    def _gather(self, kv_cache: torch.Tensor, gather_ids: torch.Tensor) -> torch.Tensor:
        """Keys then values of some blocks (``gather_ids`` from ``key_and_value_rows``), into the
        reused workspace: valid until the next gather. Returns
        ``[2 * num_blocks, block_size, num_kv_heads, head_dim]``."""
        shape = (gather_ids.numel(), *kv_cache.shape[2:])
        numel = gather_ids.numel() * kv_cache[0, 0].numel()
        workspace = self._workspace
        fits = workspace is not None and workspace.numel() >= numel
        if not fits or workspace.dtype != kv_cache.dtype or workspace.device != kv_cache.device:
            workspace = self._workspace = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        rows = kv_cache.view(-1, *kv_cache.shape[2:])  # [2 * num_cache_blocks, block_size, kv_heads, head_dim]
        return torch.index_select(rows, 0, gather_ids, out=workspace[:numel].view(shape))


def _rows_contiguous(*tensors: torch.Tensor) -> bool:
    """float32 with each token's heads one after another, contiguous (rows may sit apart: a
    fused projection's views)."""
    return all(x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in tensors)


def native_library(query: torch.Tensor, kv_cache: torch.Tensor):
    """Sonar's C kernels where they take this step's decodes: float32 queries over a contiguous
    float32 cache."""
    if query.dtype != torch.float32 or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous():
        return None
    return native.load()


def _times(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor
