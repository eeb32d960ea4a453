"""The draft model's own paged KV cache: a fixed pool of blocks allocated once, at load (so a
GPU's memory profile counts it before the target's cache is sized), handed to requests on
demand and taken back from the least recently drafted request when the pool runs short.

A drafter's cache is a cache only: a request whose blocks are taken back loses nothing but
the time to prefill it again in the drafter.
"""

from __future__ import annotations

import numpy as np
import torch

from sonar.worker.block_table import BlockTable


class DraftKVCache:
    """``num_blocks`` blocks of ``block_size`` tokens per layer, ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]`` as the attention backends read them.

    :param max_blocks_per_seq: the most blocks one sequence may hold (the drafter's context).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_table = BlockTable(max_blocks_per_seq)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks_of: dict[str, list[int]] = {}  # least recently drafted first

    @property
    def num_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, req_id: str, num_tokens: int, keep: set[str]) -> list[str] | None:
        """Give ``req_id`` room for ``num_tokens`` tokens, taking blocks back from the least
        recently drafted requests outside ``keep`` where the pool is short; returns the
        requests that lost their blocks, or None when there is no room even so (``req_id``
        then holds no blocks)."""
        blocks = self._blocks_of.pop(req_id, [])
        self._blocks_of[req_id] = blocks  # now the most recent
        needed = -(-num_tokens // self.block_size) - len(blocks)
        if needed <= 0:
            return []
        if needed + len(blocks) > self.block_table.max_blocks_per_seq:
            self.free(req_id)
            return None
        evicted: list[str] = []
        for other in list(self._blocks_of):
            if len(self._free) >= needed:
                break
            if other != req_id and other not in keep:
                self.free(other)
                evicted.append(other)
        if len(self._free) < needed:
            self.free(req_id)
            return None
        new_blocks = [self._free.pop() for _ in range(needed)]
        if blocks:
            self.block_table.append(req_id, new_blocks)
        else:
            self.block_table.add(req_id, new_blocks)
        blocks.extend(new_blocks)
        return evicted

    def free(self, req_id: str) -> None:
        """Take back every block of ``req_id`` (unknown requests are ignored)."""
        blocks = self._blocks_of.pop(req_id, None)
        if blocks is None:
            return
        if blocks:
            self.block_table.remove(req_id)
        self._free.extend(reversed(blocks))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # host memory: calloc'd pages cost nothing until a request writes them
    num_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
