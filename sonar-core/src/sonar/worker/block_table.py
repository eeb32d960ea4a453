"""The worker's block table: one persistent host row of KV block ids per running request."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Rows of block ids, one per running request, updated with only each step's new blocks;
    a step gathers the rows of its requests in one ``numpy.take``.

    :param max_blocks_per_seq: the row length (blocks of a sequence at the longest length).
    """

    def __init__(self, max_blocks_per_seq: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = np.zeros((0, max_blocks_per_seq), dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.num_blocks_of: dict[str, int] = {}
        self._free_rows: list[int] = []

    def add(self, req_id: str, block_ids: list[int]) -> None:
        """A request the worker has not seen (or sees again after a preemption)."""
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self.row_of[req_id] = self._free_rows.pop()
        self.table[row, : len(block_ids)] = block_ids
        self.num_blocks_of[req_id] = len(block_ids)

    def append(self, req_id: str, block_ids: list[int]) -> None:
        """Blocks a running request got this step."""
        if not block_ids:
            return
        row, start = self.row_of[req_id], self.num_blocks_of[req_id]
        end = start + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"request {req_id} holds {end} blocks, more than a sequence of max_model_len needs")
        self.table[row, start:end] = block_ids
        self.num_blocks_of[req_id] = end

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_blocks_of.pop(req_id, None)
            self._free_rows.append(row)

    def rows(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def gather(self, req_ids: list[str], num_columns: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """``[len(req_ids), num_columns]`` the requests' rows (the first ``num_columns`` blocks)."""
        rows = self.table[:, : num_columns or self.max_blocks_per_seq]
        return np.take(rows, self.rows(req_ids), axis=0, out=out)

    def _grow(self) -> None:
        old = len(self.table)
        new = max(2 * old, 64)
        grown = np.zeros((new, self.max_blocks_per_seq), dtype=np.int32)
        grown[:old] = self.table
        self.table = grown
        self._free_rows.extend(range(new - 1, old - 1, -1))
