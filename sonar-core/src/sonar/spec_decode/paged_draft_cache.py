"""A drafter's paged KV cache (EAGLE-3, DFlash, DSpark): one pool of blocks allocated once,
a block table per request kept on the device, writes through slot indices and reads through
the table, so a drafter pass over a padded batch has the same shapes at every step and can be
replayed from a CUDA graph.

What a request's row holds is what the per-request caches held (``eagle3_cache``,
``dflash_cache``): its slots in the order they were written, only verified context (the
target's states of positions it kept) committed; a position the drafter never saw (a
prefix-cache hit, a step in a batch too large to draft) is simply absent. Slot ``i`` of a
request lives at ``table[row, i // block_size] * block_size + i % block_size``.

Block 0 is scratch, never handed out: the padding row of a padded batch points at it (with
one readable slot, as the target's padding rows read one cached key), and so does every
column of a real row past its blocks (masked out on reads).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.spec_decode.interface import DraftCacheBudget

SCRATCH_BLOCK = 0


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # host memory: calloc'd pages cost nothing until a request writes them
    num_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def pool_blocks_for(num_target_blocks: int, max_num_seqs: int, block_size: int, num_temporary_slots: int) -> int:
    """Blocks a drafter's pool needs so that it never runs short while the target does not.

    A request's committed slots are target positions it computed itself (hits and recomputed
    positions are never written twice), so they fit in the blocks the target holds for the
    running requests; each request may round up by one block more than the target does and
    holds ``num_temporary_slots`` slots of its own guesses on top."""
    per_request = 1 + -(-num_temporary_slots // block_size)
    return num_target_blocks + max_num_seqs * per_request


class PagedDraftCache:
    """Keys and values ``[layers, 2, 1 + num_blocks, block_size, kv_heads, head_dim]`` (block
    0 scratch), each slot's position, and a device block table of ``max_requests`` rows plus
    a padding row.

    :param max_slots_per_request: the most slots one request holds (its context, plus the
        temporary slots of a drafting step).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        max_requests: int,
        max_slots_per_request: int,
    ) -> None:
        if num_blocks < 1 or max_requests < 1 or block_size < 1:
            raise ValueError(f"a drafter cache needs at least one block, request and slot per block (got {num_blocks}, {max_requests}, {block_size})")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_requests = max_requests
        self.max_blocks_per_request = -(-max_slots_per_request // block_size)
        self.kv = _zeros((num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim), dtype, device)
        self.positions = torch.zeros((num_blocks + 1) * block_size, dtype=torch.int64, device=device)
        self.padding_row = max_requests
        self.table = torch.zeros((max_requests + 1, self.max_blocks_per_request), dtype=torch.int64, device=device)
        self.device_lengths = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)  # committed slots per row
        self.device_lengths[self.padding_row] = 1
        self.lengths: dict[str, int] = {}  # slots written, temporary ones included
        self.committed: dict[str, int] = {}  # slots of verified context
        self._row_of: dict[str, int] = {}
        self._blocks_of: dict[str, list[int]] = {}
        self._free_blocks = list(range(num_blocks, 0, -1))
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one slot of one request takes (keys, values and its position)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size() + 8

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.positions.numel() * 8

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    def row_of(self, req_id: str) -> int:
        """The request's table row (the padding row for a request with no slots)."""
        return self._row_of.get(req_id, self.padding_row)

    def reserve(self, req_id: str, num_slots: int) -> None:
        """Give ``req_id`` blocks for ``num_slots`` slots in all (a row first, if it has none).

        :raises ValueError: more slots than one request may hold.
        :raises RuntimeError: the pool is out of blocks or rows (it is sized so that this does
            not happen while the target's own cache holds the requests).
        """
        self._write_table(self._grow(req_id, num_slots))

    def reserve_many(self, wanted: list[tuple[str, int]]) -> None:
        """``reserve`` for each ``(req_id, num_slots)``, the table written in one copy."""
        grown: list[tuple[int, int, int]] = []
        for req_id, num_slots in wanted:
            grown += self._grow(req_id, num_slots)
        self._write_table(grown)

    def _grow(self, req_id: str, num_slots: int) -> list[tuple[int, int, int]]:
        """Hand ``req_id`` the blocks ``num_slots`` slots need on the host: the ``(row,
        column, block)`` table entries to write (see ``reserve``)."""
        row = self._row_of.get(req_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError(f"the drafter cache holds {self.max_requests} requests already (max_num_seqs); request {req_id} has no row")
            row = self._row_of[req_id] = self._free_rows.pop()
            self._blocks_of[req_id] = []
            self.lengths[req_id] = self.committed[req_id] = 0
        blocks = self._blocks_of[req_id]
        needed = -(-num_slots // self.block_size)
        if needed > self.max_blocks_per_request:
            raise ValueError(
                f"request {req_id} needs {num_slots} drafter slots, more than the {self.max_blocks_per_request * self.block_size} "
                "one request may hold (max_model_len plus the drafting step's own)"
            )
        if needed <= len(blocks):
            return []
        if needed - len(blocks) > len(self._free_blocks):
            raise RuntimeError(
                f"the drafter cache is out of blocks ({self.num_blocks} of {self.block_size} slots, {len(self._free_blocks)} free): "
                f"request {req_id} needs {needed - len(blocks)} more; the pool is sized from the target's block budget"
            )
        start = len(blocks)
        new_blocks = [self._free_blocks.pop() for _ in range(needed - start)]
        blocks.extend(new_blocks)
        return [(row, start + i, block) for i, block in enumerate(new_blocks)]

    def _write_table(self, entries: list[tuple[int, int, int]]) -> None:
        """Write ``(row, column, block)`` entries into the device table, in one copy."""
        if not entries:
            return
        rows, columns, blocks = to_device(np.asarray(entries, dtype=np.int64).T.copy(), self.device)
        self.table.index_put_((rows, columns), blocks)

    def _host_slots(self, req_id: str, start: int, count: int) -> np.ndarray:
        """The pool slots of the request's slots ``start .. start + count - 1``."""
        index = np.arange(start, start + count)
        blocks = np.asarray(self._blocks_of[req_id], dtype=np.int64)
        return blocks[index // self.block_size] * self.block_size + index % self.block_size

    def _write(self, slots: np.ndarray, kv: torch.Tensor, positions: torch.Tensor | None) -> None:
        """``kv [layers, 2, n, kv_heads, head_dim]`` (and ``positions [n]``) into pool slots
        ``slots [n]``, copied to the device through pinned memory (no wait for the device)."""
        self.write_slots(to_device(slots, self.device), [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])], positions)

    def write_slots(self, slots: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor | None = None) -> None:
        """Every layer's keys and values ``[n, kv_heads, head_dim]`` (``layers[i]``) and the
        ``positions [n]`` into pool slots ``slots [n]``, all on the device (graph-safe)."""
        flat = self.kv.view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        for layer, (keys, values) in enumerate(layers):
            flat[layer, 0].index_copy_(0, slots, keys.to(self.dtype))
            flat[layer, 1].index_copy_(0, slots, values.to(self.dtype))
        if positions is not None:
            self.positions.index_copy_(0, slots, positions.to(self.device, torch.int64))

    def claim_many(self, req_ids: list[str], counts: list[int]) -> torch.Tensor | None:
        """Commit ``counts[i]`` slots after request ``req_ids[i]``'s last, for every request at
        once (a count of 0 leaves its request alone), and return their pool slots ``[sum(counts)]``
        on the device, request after request (None where there are none) for the caller to
        write (``write_slots``). The blocks handed out, the committed lengths and the slots go
        to the device in one copy."""
        slots: list[int] = []
        rows, lengths = [], []
        grown: list[tuple[int, int, int]] = []  # table entries of blocks handed out here
        size = self.block_size
        for req_id, count in zip(req_ids, counts):
            if not count:
                continue
            length = self.lengths.get(req_id, 0)
            end = length + count
            blocks = self._blocks_of.get(req_id)
            if blocks is None or len(blocks) * size < end:
                grown += self._grow(req_id, end)
                blocks = self._blocks_of[req_id]
            slots.extend(blocks[i // size] * size + i % size for i in range(length, end))
            self.lengths[req_id] = self.committed[req_id] = end
            rows.append(self._row_of[req_id])
            lengths.append(end)
        if not rows:
            return None
        n, m, g = len(slots), len(rows), len(grown)
        packed = np.empty(n + 2 * m + 3 * g, dtype=np.int64)
        packed[:n], packed[n : n + m], packed[n + m : n + 2 * m] = slots, rows, lengths
        if g:
            packed[n + 2 * m :] = np.asarray(grown, dtype=np.int64).T.reshape(-1)
        on_device = to_device(packed, self.device)
        if g:
            table = on_device[n + 2 * m :].view(3, g)
            self.table.index_put_((table[0], table[1]), table[2])
        self.device_lengths.index_copy_(0, on_device[n : n + m], on_device[n + m : n + 2 * m])
        return on_device[:n]

    def settle(self, req_id: str, length: int) -> None:
        """The host's length of a request whose last slots were claimed provisionally (a
        chained drafting step) and whose device length was already cut to ``length`` on the
        device: the slots past it are free again (unknown requests are ignored)."""
        if req_id in self.lengths:
            self.lengths[req_id] = self.committed[req_id] = length

    def append(self, req_id: str, kv: torch.Tensor, positions: torch.Tensor | None = None, commit: bool = True) -> None:
        """Write ``kv [layers, 2, n, kv_heads, head_dim]`` after the request's last slot (its
        positions ``[n]`` where a reader masks by position); ``commit``: verified context."""
        length = self.lengths.get(req_id, 0)
        n = kv.shape[2]
        self.reserve(req_id, length + n)
        self._write(self._host_slots(req_id, length, n), kv, positions)
        self.lengths[req_id] = length + n
        if commit:
            self.committed[req_id] = length + n
            self.device_lengths[self._row_of[req_id]] = length + n

    def rollback(self, req_id: str) -> None:
        """Drop the request's temporary slots."""
        if req_id in self.lengths:
            self.lengths[req_id] = self.committed[req_id]

    def remove(self, req_id: str) -> None:
        """Give the request's blocks and row back (unknown requests are ignored)."""
        row = self._row_of.pop(req_id, None)
        if row is None:
            return
        self._free_blocks.extend(reversed(self._blocks_of.pop(req_id)))
        self.table[row].fill_(SCRATCH_BLOCK)
        self.device_lengths[row] = 0
        self._free_rows.append(row)
        self.lengths.pop(req_id, None)
        self.committed.pop(req_id, None)

    # -- reads on the device (no host values: graph-safe) ---------------------------------

    def device_slots(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Pool slots of slot ``index[r]`` of each row ``rows[r]``."""
        blocks = self.table[rows, index // self.block_size]
        return blocks * self.block_size + index % self.block_size

    def write_rows(self, layer: int, rows: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one slot per row (``keys``/``values [R, kv_heads, head_dim]``) at ``index [R]``."""
        slots = self.device_slots(rows, index)
        flat = self.kv[layer].view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, keys.to(self.dtype))
        flat[1].index_copy_(0, slots, values.to(self.dtype))

    def read(self, layer: int, rows: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, num_slots, kv_heads, head_dim]`` of the rows' first
        ``num_slots`` slots (past a row's own: whatever the scratch or reused block holds;
        mask them)."""
        num_columns = -(-num_slots // self.block_size)
        blocks = self.table[rows, :num_columns]  # [R, C]
        kv = self.kv[layer][:, blocks]  # [2, R, C, block, KVH, D]
        kv = kv.flatten(2, 3)[:, :, :num_slots]
        return kv[0], kv[1]

    def read_positions(self, rows: torch.Tensor, num_slots: int) -> torch.Tensor:
        """The positions ``[R, num_slots]`` of the rows' first ``num_slots`` slots."""
        num_columns = -(-num_slots // self.block_size)
        blocks = self.table[rows, :num_columns]
        slots = blocks[:, :, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)
        return self.positions[slots.flatten(1)[:, :num_slots]]

    def attend(self, layer: int, rows: torch.Tensor, queries: torch.Tensor, seen: torch.Tensor, num_slots: int, scale: float) -> torch.Tensor:
        """One query per row (``queries [R, heads, head_dim]``) over the row's first
        ``seen[r]`` slots of the ``num_slots`` read: ``[R, heads, head_dim]``."""
        keys, values = self.read(layer, rows, num_slots)  # [R, S, KVH, D]
        mask = torch.arange(num_slots, device=keys.device)[None, :] < seen[:, None]
        out = F.scaled_dot_product_attention(
            queries[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )  # [R, H, 1, D]
        return out[:, :, 0]

    def layers(self, rows: torch.Tensor, num_slots: int) -> "LayerReads":
        """Every layer's keys and values of the rows, gathered one layer at a time as a pass
        iterates over them (one layer's copy alive at once)."""
        return LayerReads(self, rows, num_slots)


class LayerReads:
    """An iterable of ``(keys, values)`` per layer, read from the pool on demand."""

    def __init__(self, cache: PagedDraftCache, rows: torch.Tensor, num_slots: int) -> None:
        self.cache, self.rows, self.num_slots = cache, rows, num_slots

    def __len__(self) -> int:
        return self.cache.num_layers

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for layer in range(self.cache.num_layers):
            yield self.cache.read(layer, self.rows, self.num_slots)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(layer, self.rows, self.num_slots)


#: Limits of a drafter cache built without a model runner (a proposer used on its own).
STANDALONE_BUDGET = dict(num_target_blocks=256, block_size=16, max_num_seqs=16, max_model_len=4096)


def build_draft_cache(
    budget: DraftCacheBudget,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_temporary_slots: int = 0,
) -> PagedDraftCache:
    """A drafter's pool for ``budget`` (``pool_blocks_for``), rows for ``max_num_seqs``
    requests of up to ``max_model_len`` slots plus ``num_temporary_slots``."""
    return PagedDraftCache(
        num_layers, num_kv_heads, head_dim, dtype, device,
        block_size=budget.block_size,
        num_blocks=pool_blocks_for(budget.num_target_blocks, budget.max_num_seqs, budget.block_size, num_temporary_slots),
        max_requests=budget.max_num_seqs,
        max_slots_per_request=budget.max_model_len + num_temporary_slots,
    )  # fmt: skip
