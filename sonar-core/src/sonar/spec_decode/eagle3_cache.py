"""The EAGLE-3 head's own KV cache: per request, the keys and values of every slot it ran
from the target's states, in position order (a position the head never saw is simply absent).

Slots a drafting step adds from the head's own guesses are temporary: ``rollback`` drops them
once the step's drafts are out, and the next step writes those positions again from the
target's verified states, exactly as the target's cache overwrites rejected positions.

The proposer keeps its cache in ``paged_draft_cache`` (fixed shapes, CUDA graphs); this
per-request form is the reference the paged cache is tested against.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

MIN_CAPACITY = 64


class DraftKVCache:
    """Keys and values ``[capacity, kv_heads, head_dim]`` per request, grown by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self._keys: dict[str, torch.Tensor] = {}
        self._values: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}  # slots written, temporary ones included
        self.committed: dict[str, int] = {}  # slots from the target's states

    def append(self, req_id: str, keys: torch.Tensor, values: torch.Tensor, commit: bool) -> None:
        """Add ``[n, kv_heads, head_dim]`` slots after the request's last one."""
        length = self.lengths.get(req_id, 0)
        needed = length + keys.shape[0]
        stored = self._keys.get(req_id)
        if stored is None or needed > stored.shape[0]:
            capacity = max(MIN_CAPACITY, 2 * needed)
            shape = (capacity, self.num_kv_heads, self.head_dim)
            grown_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            grown_v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if stored is not None:
                grown_k[:length] = stored[:length]
                grown_v[:length] = self._values[req_id][:length]
            self._keys[req_id], self._values[req_id] = grown_k, grown_v
        self._keys[req_id][length:needed] = keys
        self._values[req_id][length:needed] = values
        self.lengths[req_id] = needed
        if commit:
            self.committed[req_id] = needed

    def rollback(self, req_id: str) -> None:
        """Drop the request's temporary slots."""
        if req_id in self.lengths:
            self.lengths[req_id] = self.committed.get(req_id, 0)

    def attend(self, req_id: str, queries: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the request's last ``n`` slots (``queries [n, heads, head_dim]``, their
        keys already appended) over its cache, each slot seeing those before it and itself."""
        length = self.lengths[req_id]
        n = queries.shape[0]
        keys = self._keys[req_id][:length].transpose(0, 1)  # [KVH, L, D]
        values = self._values[req_id][:length].transpose(0, 1)
        mask = None
        if n > 1:
            rows = torch.arange(length - n, length, device=queries.device)[:, None]
            mask = torch.arange(length, device=queries.device)[None, :] <= rows  # [n, L]
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [H, n, D]
        return out.transpose(0, 1)

    def remove(self, req_id: str) -> None:
        for table in (self._keys, self._values, self.lengths, self.committed):
            table.pop(req_id, None)
