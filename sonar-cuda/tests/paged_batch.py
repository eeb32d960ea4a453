"""Random paged KV caches and batches for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtypes the interpreter can run every kernel in (its bf16 matrix product is broken)
INTERPRETER_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def dtypes_for(device: torch.device) -> tuple[torch.dtype, ...]:
    return GPU_DTYPES if device.type == "cuda" else INTERPRETER_DTYPES


@dataclass(slots=True)
class PagedBatch:
    k_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]; NaN outside sequences
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> PagedBatch:
    """Sequences scattered over shuffled pages; every slot no sequence owns holds NaN, so a kernel
    that reads outside its sequence fails the comparison."""
    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)[: sum(pages_per_seq)].tolist()
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.zeros(len(seq_lens), max(pages_per_seq) + 1, dtype=torch.int32)
    for i, (seq_len, num_pages) in enumerate(zip(seq_lens, pages_per_seq)):
        pages, order = order[:num_pages], order[num_pages:]
        block_tables[i, :num_pages] = torch.tensor(pages, dtype=torch.int32)
        positions = torch.arange(seq_len)
        page_ids = block_tables[i].long()[positions // page_size]
        k_cache[page_ids, positions % page_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v_cache[page_ids, positions % page_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
    return PagedBatch(
        k_cache.to(device), v_cache.to(device), block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
