"""Per-step attention state for the CPU backend, computed once per step and shared by all layers.

Decodes are grouped into buckets of similar length: each bucket is one batched SDPA call over
its sequences' blocks gathered into a padded ``[n, max_len, num_kv_heads, head_dim]`` tensor,
so a batch mixing short and long sequences does not pad everything to the longest one. Prefill
chunks are attended one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sonar.attention import AttentionMetadata

#: What one extra SDPA call costs, in gathered tokens (measured: the fixed cost of a call is
#: close to that of gathering and attending ~256 more cached tokens of a 135M model).
BUCKET_CALL_COST_TOKENS = 256


@dataclass(slots=True)
class DecodeBucket:
    """Decode sequences attended in one batched call."""

    rows: slice | torch.Tensor  # positions in the step's decode tokens; a slice when contiguous
    seq_lens: torch.Tensor  # [n] int64, device
    seq_lens_cpu: list[int]
    max_seq_len: int
    # built for a block size on first use:
    block_ids: torch.Tensor | None = None  # [n * num_blocks] int64
    num_blocks: int = 0
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict)  # [n, 1, 1, S]


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's new tokens ``[start, end)``, after ``context_len`` cached tokens."""

    start: int
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None = None  # [num_blocks] int64, built on first use
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)  # [q_len, seq_len]


@dataclass(slots=True)
class CpuAttentionPlan:
    """``AttentionMetadata.extra`` for ``CpuAttentionBackend``."""

    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]
    block_size: int | None = None  # block-dependent fields are built for this size

    def bind_block_size(self, block_size: int, block_tables: torch.Tensor, num_decodes: int) -> None:
        """Build the gather indices for ``block_size`` (once per step: the first layer does it)."""
        if self.block_size == block_size:
            return
        decode_tables = block_tables[:num_decodes]
        for bucket in self.decode_buckets:
            bucket.num_blocks = -(-bucket.max_seq_len // block_size)
            bucket.block_ids = decode_tables[bucket.rows, : bucket.num_blocks].reshape(-1).long()
            bucket.masks.clear()
        for i, chunk in enumerate(self.prefills):
            if chunk.context_len > 0:
                num_blocks = -(-chunk.seq_len // block_size)
                chunk.block_ids = block_tables[num_decodes + i, :num_blocks].long()
        self.block_size = block_size

    def decode_mask(self, bucket: DecodeBucket, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``[n, 1, 1, S]`` additive mask: 0 where a cached position is attended, -inf where it is
        padding or outside the window (None: attend to all)."""
        if (window, dtype) not in bucket.masks:
            assert self.block_size is not None
            padded_len = bucket.num_blocks * self.block_size
            positions = torch.arange(padded_len, device=bucket.seq_lens.device)
            valid = positions[None, :] < bucket.seq_lens[:, None]
            if window is not None:
                valid &= positions[None, :] >= bucket.seq_lens[:, None] - window
            all_valid = window is None and min(bucket.seq_lens_cpu) == padded_len
            bucket.masks[window, dtype] = None if all_valid else additive_mask(valid[:, None, None, :], dtype)
        return bucket.masks[window, dtype]

    @staticmethod
    def prefill_mask(chunk: PrefillChunk, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[q_len, seq_len]`` additive mask: 0 where query ``i`` (at ``context_len + i``) sees a
        key, -inf elsewhere."""
        if (window, dtype) not in chunk.masks:
            query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device)[:, None]
            key_pos = torch.arange(chunk.seq_len, device=device)[None, :]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= key_pos > query_pos - window
            chunk.masks[window, dtype] = additive_mask(allowed, dtype)
        return chunk.masks[window, dtype]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere (SDPA adds a float mask without converting it)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def split_into_buckets(seq_lens: list[int], call_cost: int = BUCKET_CALL_COST_TOKENS) -> list[list[int]]:
    """Group sequence indices so that ``sum(len(group) * max_len(group)) + call_cost * groups``
    is minimal (groups are runs of the length-sorted order; exact, by dynamic programming)."""
    n = len(seq_lens)
    if n == 0:
        return []
    order = np.argsort(np.asarray(seq_lens), kind="stable")
    lens = np.asarray(seq_lens, dtype=np.int64)[order]
    # best[j]: cheapest cost of the first j sorted sequences; the last group is [i, j)
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n + 1, dtype=np.int64)
    starts = np.arange(n)
    for j in range(1, n + 1):
        costs = best[:j] + call_cost + (j - starts[:j]) * lens[j - 1]
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(sorted(order[cut[j] : j].tolist()))
        j = int(cut[j])
    return groups[::-1]


def build_plan(metadata: AttentionMetadata) -> CpuAttentionPlan:
    """The block-size-independent part of the plan: decode buckets and prefill chunks."""
    num_decodes = metadata.num_decodes
    device = metadata.seq_lens.device
    decode_lens = metadata.seq_lens_cpu[:num_decodes]
    buckets: list[DecodeBucket] = []
    for group in split_into_buckets(decode_lens):
        contiguous = group == list(range(group[0], group[0] + len(group)))
        rows: slice | torch.Tensor = (
            slice(group[0], group[0] + len(group)) if contiguous else torch.tensor(group, dtype=torch.long, device=device)
        )
        lens_cpu = [decode_lens[i] for i in group]
        buckets.append(
            DecodeBucket(rows, metadata.seq_lens[:num_decodes][rows].long(), lens_cpu, max(lens_cpu))
        )
    starts = metadata.query_start_loc_cpu
    prefills = [
        PrefillChunk(starts[i], starts[i + 1], metadata.seq_lens_cpu[i] - (starts[i + 1] - starts[i]), metadata.seq_lens_cpu[i])
        for i in range(num_decodes, metadata.num_seqs)
    ]
    return CpuAttentionPlan(buckets, prefills)
