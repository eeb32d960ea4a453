"""The DFlash drafter's own KV cache: per request, every draft layer's keys and values of the
target's hidden states it was handed (the context a block attends to), in position order.

Only verified context is ever written (the target's states of the tokens it kept), so nothing
is rolled back: a block's own keys live for one pass. A position the drafter never saw (a
prefix-cache hit, a step in a batch too large to draft) is simply absent.

The proposers keep their cache in ``paged_draft_cache`` (fixed shapes, CUDA graphs); this
per-request form is the reference the paged cache is tested against.
"""

from __future__ import annotations

import torch

from sonar.spec_decode.dflash_model import LayerKV

MIN_CAPACITY = 64


class ContextKVCache:
    """Keys and values ``[layers, 2, capacity, kv_heads, head_dim]`` and positions per request."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._kv: dict[str, torch.Tensor] = {}
        self._positions: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}

    def append(self, req_id: str, context: list[LayerKV], positions: torch.Tensor) -> None:
        """Add ``n`` context slots (``context[layer]``: keys, values ``[n, kv_heads, head_dim]``)."""
        length = self.lengths.get(req_id, 0)
        needed = length + positions.shape[0]
        stored = self._kv.get(req_id)
        if stored is None or needed > stored.shape[2]:
            capacity = max(MIN_CAPACITY, 2 * needed)
            grown = torch.empty((self.num_layers, 2, capacity, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
            grown_positions = torch.empty(capacity, dtype=torch.int64, device=self.device)
            if stored is not None:
                grown[:, :, :length] = stored[:, :, :length]
                grown_positions[:length] = self._positions[req_id][:length]
            self._kv[req_id], self._positions[req_id] = grown, grown_positions
        kv = self._kv[req_id]
        for layer, (keys, values) in enumerate(context):
            kv[layer, 0, length:needed] = keys
            kv[layer, 1, length:needed] = values
        self._positions[req_id][length:needed] = positions
        self.lengths[req_id] = needed

    def gather(self, req_ids: list[str]) -> tuple[list[LayerKV], torch.Tensor, torch.Tensor]:
        """The context of ``req_ids`` padded to the longest: per layer keys and values
        ``[R, L, kv_heads, head_dim]``, positions ``[R, L]`` and which slots are real ``[R, L]``."""
        lengths = [self.lengths.get(r, 0) for r in req_ids]
        longest = max(lengths)
        if len(req_ids) == 1 and longest:  # one request: its own storage, no copy
            kv = self._kv[req_ids[0]][:, :, :longest].unsqueeze(2)  # [layers, 2, 1, L, KVH, D]
            positions = self._positions[req_ids[0]][:longest].unsqueeze(0)
            valid = torch.ones(1, longest, dtype=torch.bool, device=self.device)
        else:
            kv = torch.zeros((self.num_layers, 2, len(req_ids), longest, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
            positions = torch.zeros(len(req_ids), longest, dtype=torch.int64, device=self.device)
            for row, (req_id, length) in enumerate(zip(req_ids, lengths)):
                if length:
                    kv[:, :, row, :length] = self._kv[req_id][:, :, :length]
                    positions[row, :length] = self._positions[req_id][:length]
            valid = torch.arange(longest, device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        return [(kv[layer, 0], kv[layer, 1]) for layer in range(self.num_layers)], positions, valid

    def remove(self, req_id: str) -> None:
        for table in (self._kv, self._positions, self.lengths):
            table.pop(req_id, None)
