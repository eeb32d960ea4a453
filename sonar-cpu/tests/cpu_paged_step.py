"""Random paged-attention steps for tests and benchmarks: a filled cache and a step's metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.attention import AttentionMetadata


@dataclass(slots=True)
class PagedStep:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata


def make_metadata(
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    generator: torch.Generator,
    spare_blocks: int = 3,
    scattered: bool = True,
) -> tuple[AttentionMetadata, int]:
    """Metadata for sequences holding ``context_lens`` cached tokens and ``query_lens`` new ones
    (decodes first), their blocks scattered at random over the cache (``scattered``) or handed
    out in order. Returns it and the number of blocks the cache needs."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist() if scattered else list(range(num_blocks))[::-1]
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (context_len, seq_len, n_blocks) in enumerate(zip(context_lens, seq_lens, blocks_per_seq)):
        table = [order.pop() for _ in range(n_blocks)]
        block_tables[i, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(context_len, seq_len)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    metadata = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return metadata, num_blocks


def make_step(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    scattered: bool = True,
) -> PagedStep:
    """A step over a cache filled with random values (cached contexts included)."""
    generator = torch.Generator().manual_seed(seed)
    metadata, num_blocks = make_metadata(context_lens, query_lens, block_size, generator, scattered=scattered)
    num_tokens = metadata.num_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return PagedStep(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_dim),
        metadata=metadata,
    )
