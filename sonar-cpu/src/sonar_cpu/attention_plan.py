"""Per-step attention state for the CPU backend, computed once per step and shared by all layers.

Decodes are attended in batched SDPA calls, each over its sequences' blocks gathered from the
cache into a padded ``[n, padded_len, num_kv_heads, head_dim]`` tensor. Two things decide which
sequences share a call:

- length: decodes are grouped so that a batch mixing short and long sequences does not pad
  everything to the longest one (``split_into_buckets``);
- size: a call gathers at most ``MAX_GATHER_BYTES``, so what it gathers is still in the CPU's
  caches when SDPA reads it back (one 64-sequence gather of a few tens of MB goes to DRAM and
  back, and costs several times more).

Prefill chunks are attended one sequence at a time (short ones, where the C decode kernel runs,
as decode rows: ``SHORT_CHUNK_TOKENS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sonar.attention import AttentionMetadata

#: What one extra SDPA call costs, in gathered tokens (measured: the fixed cost of a call is
#: close to that of gathering and attending ~256 more cached tokens of a 135M model).
BUCKET_CALL_COST_TOKENS = 256
#: The most K and V bytes one decode call gathers (about what stays in L2/L3 cache).
MAX_GATHER_BYTES = 4 * 1024**2
#: Where a kernel reads the block tables itself (the C decode kernel), a chunk of at most this
#: many new tokens after a cached context (a verify step's drafts, a short continuation) is
#: attended as decode rows, one per token: token ``i`` of the chunk is the last token of a
#: sequence of ``context_len + i + 1`` tokens, which is exactly its causal attention. All such
#: rows of a step go in the decodes' one call instead of one prefill call per sequence.
SHORT_CHUNK_TOKENS = 16

MaskCache = dict[tuple[int | None, torch.dtype], torch.Tensor | None]


@dataclass(slots=True)
class DecodeBucket:
    """Decode sequences attended in one batched call."""

    rows: slice | torch.Tensor  # positions in the step's decode tokens; a slice when contiguous
    seq_lens: torch.Tensor  # [n] int64
    num_blocks: int  # blocks gathered per sequence
    gather_ids: torch.Tensor  # [2 * n * num_blocks] int64 rows of the cache seen as [2 * blocks, ...]
    all_full: bool  # every sequence fills all num_blocks blocks: no padding to mask
    masks: MaskCache = field(default_factory=dict)  # (window, dtype) -> [n, 1, 1, padded_len]
    single_len: int | None = None  # one sequence: its length (attended unpadded, without a mask)
    first_block: int | None = None  # one sequence in consecutive blocks from here: read in place

    def attended_span(self, window: int | None) -> tuple[int, int]:
        """A single sequence's attended positions ``[start, end)``: its last ``window`` tokens, or all."""
        assert self.single_len is not None
        return (0 if window is None else max(0, self.single_len - window)), self.single_len


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's new tokens ``[start, end)``, after ``context_len`` cached tokens."""

    start: int
    end: int
    context_len: int
    seq_len: int
    gather_ids: torch.Tensor | None = None  # [2 * num_blocks] int64, built on first use
    masks: MaskCache = field(default_factory=dict)  # (window, dtype) -> [q_len, seq_len]


@dataclass(slots=True)
class DecodeRows:
    """The rows a block-table kernel attends as decodes: the step's decodes, then every token
    of its short chunks (``SHORT_CHUNK_TOKENS``), each with its own length."""

    query_rows: slice | torch.Tensor  # rows of the step's query (and output); a slice when contiguous
    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous: each row's sequence's table
    seq_lens: torch.Tensor  # [n] int32: each row's position + 1
    prefills: list[PrefillChunk]  # the chunks left to attend as prefills

    @property
    def num_rows(self) -> int:
        return self.seq_lens.numel()


@dataclass(slots=True)
class CpuAttentionPlan:
    """``AttentionMetadata.extra`` for ``CpuAttentionBackend``."""

    decode_groups: list[list[int]]  # decode indices grouped by length
    decode_seq_lens_cpu: list[int]
    prefills: list[PrefillChunk]
    decode_buckets: list[DecodeBucket] = field(default_factory=list)  # built by bind()
    decode_rows: DecodeRows | None = None  # built by bind() for a block-table kernel
    bound_to: tuple[int, int, int, bool] | None = None  # (block_size, bytes per cached token, cache blocks, buckets)

    def bind(self, kv_cache: torch.Tensor, metadata: AttentionMetadata, decode_buckets: bool = True) -> None:
        """Build the calls and gather indices for this cache layout (the first layer does it;
        the others find it done); the decodes' buckets only with ``decode_buckets`` (a kernel
        that reads the block tables itself needs none)."""
        _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        layout = (block_size, 2 * num_kv_heads * head_dim * kv_cache.element_size(), num_cache_blocks, decode_buckets)
        if self.bound_to == layout:
            return
        num_decodes = metadata.num_decodes
        decode_tables = metadata.block_tables[:num_decodes]
        decode_lens = metadata.seq_lens[:num_decodes]
        self.decode_buckets = []
        self.decode_rows = None if decode_buckets else self._decode_rows(metadata)
        for group in self.decode_groups if decode_buckets else ():
            num_blocks = -(-max(self.decode_seq_lens_cpu[i] for i in group) // block_size)
            per_call = max(1, MAX_GATHER_BYTES // (num_blocks * block_size * layout[1]))
            for first in range(0, len(group), per_call):
                members = group[first : first + per_call]
                rows = index_or_slice(members, decode_lens.device)
                block_ids = decode_tables[rows, :num_blocks]
                bucket = DecodeBucket(
                    rows=rows,
                    seq_lens=decode_lens[rows].long(),
                    num_blocks=num_blocks,
                    gather_ids=key_and_value_rows(block_ids, num_cache_blocks),
                    all_full=min(self.decode_seq_lens_cpu[i] for i in members) == num_blocks * block_size,
                )
                if len(members) == 1:
                    bucket.single_len = self.decode_seq_lens_cpu[members[0]]
                    bucket.first_block = first_of_consecutive(block_ids.reshape(-1).tolist())
                self.decode_buckets.append(bucket)
        attended = self.prefills if self.decode_rows is None else self.decode_rows.prefills
        left = {id(chunk) for chunk in attended}  # short chunks taken as decode rows gather nothing
        for i, chunk in enumerate(self.prefills):
            if chunk.context_len > 0 and id(chunk) in left:
                num_blocks = -(-chunk.seq_len // block_size)
                chunk.gather_ids = key_and_value_rows(metadata.block_tables[num_decodes + i, :num_blocks], num_cache_blocks)
        self.bound_to = layout

    def _decode_rows(self, metadata: AttentionMetadata) -> DecodeRows:
        num_decodes = metadata.num_decodes
        short = [
            (i, chunk) for i, chunk in enumerate(self.prefills)
            if chunk.context_len > 0 and chunk.end - chunk.start <= SHORT_CHUNK_TOKENS
        ]  # fmt: skip
        if not short:
            return DecodeRows(
                slice(0, num_decodes), metadata.block_tables[:num_decodes].contiguous(), metadata.seq_lens[:num_decodes].contiguous(),
                self.prefills,
            )  # fmt: skip
        rows, sequences, lens = list(range(num_decodes)), list(range(num_decodes)), list(self.decode_seq_lens_cpu)
        for i, chunk in short:
            rows += range(chunk.start, chunk.end)
            sequences += [num_decodes + i] * (chunk.end - chunk.start)
            lens += range(chunk.context_len + 1, chunk.seq_len + 1)
        device = metadata.seq_lens.device
        taken = {i for i, _ in short}
        return DecodeRows(
            query_rows=index_or_slice(rows, device),
            block_tables=metadata.block_tables[torch.tensor(sequences, dtype=torch.long, device=device)].contiguous(),
            seq_lens=torch.tensor(lens, dtype=metadata.seq_lens.dtype, device=device),
            prefills=[chunk for i, chunk in enumerate(self.prefills) if i not in taken],
        )

    def decode_mask(self, bucket: DecodeBucket, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``[n, 1, 1, padded_len]`` additive mask: 0 where a cached position is attended, -inf
        where it is padding or outside the window (None: attend to all)."""
        if (window, dtype) not in bucket.masks:
            assert self.bound_to is not None
            padded_len = bucket.num_blocks * self.bound_to[0]
            positions = torch.arange(padded_len, device=bucket.seq_lens.device)
            valid = positions[None, :] < bucket.seq_lens[:, None]
            if window is not None:
                valid &= positions[None, :] >= bucket.seq_lens[:, None] - window
            no_mask = window is None and bucket.all_full
            bucket.masks[window, dtype] = None if no_mask else additive_mask(valid[:, None, None, :], dtype)
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


def key_and_value_rows(block_ids: torch.Tensor, num_cache_blocks: int) -> torch.Tensor:
    """Rows of a cache viewed as ``[2 * num_cache_blocks, ...]`` holding these blocks' keys, then
    their values (gathering along the first dimension runs on every thread)."""
    flat = block_ids.reshape(-1).long()
    return torch.cat([flat, flat + num_cache_blocks])


def first_of_consecutive(block_ids: list[int]) -> int | None:
    """The first id where ``block_ids`` are consecutive (``[7, 8, 9]`` -> 7), else None."""
    first = block_ids[0]
    return first if block_ids == list(range(first, first + len(block_ids))) else None


def index_or_slice(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice where ``indices`` are consecutive (indexing with it is a view), else a tensor."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices, dtype=torch.long, device=device)


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


def build_plan(metadata: AttentionMetadata, call_cost: int = BUCKET_CALL_COST_TOKENS) -> CpuAttentionPlan:
    """The layout-independent part of the plan: decodes grouped by length (see
    ``split_into_buckets``) and the prefill chunks."""
    num_decodes = metadata.num_decodes
    decode_lens = metadata.seq_lens_cpu[:num_decodes]
    starts = metadata.query_start_loc_cpu
    prefills = [
        PrefillChunk(starts[i], starts[i + 1], metadata.seq_lens_cpu[i] - (starts[i + 1] - starts[i]), metadata.seq_lens_cpu[i])
        for i in range(num_decodes, metadata.num_seqs)
    ]
    return CpuAttentionPlan(split_into_buckets(decode_lens, call_cost), decode_lens, prefills)
