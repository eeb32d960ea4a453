"""The batched token mask: one call fills the allowed-token bitmask of every constrained
request, one call applies it to the logits rows it constrains."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sonar.structured_output.matcher import RequestGrammar


class GrammarBitmask:
    """Fills the allowed-token bitmask of a batch's active grammars, on xgrammar's threads.

    Keeps one host buffer, grown to the largest batch seen.

    :param vocab_size: the model's logits width.
    :param num_threads: threads that fill bitmasks (``"auto"``: xgrammar decides).
    """

    def __init__(self, vocab_size: int, num_threads: int | str = "auto") -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._batch_matcher = xgr.BatchGrammarMatcher(num_threads)
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)  # [rows, ceil(vocab / 32)] int32

    def fill(self, grammars: Sequence[RequestGrammar | None]) -> tuple[list[int], torch.Tensor]:
        """The positions in ``grammars`` of the active ones, and their bitmask rows in that
        order (``[len(rows), ceil(V / 32)]`` int32, a copy)."""
        import xgrammar as xgr

        rows = [i for i, grammar in enumerate(grammars) if grammar is not None and grammar.active]
        if not rows:
            return rows, self._bitmask[:0].clone()
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bitmask)
        return rows, bitmask.clone()

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """Mask ``logits`` ``[B, V]`` in place; row ``i`` follows ``grammars[i]`` (None: free).
        Returns the rows that were masked."""
        rows, bitmask = self.fill(grammars)
        if rows:
            apply_grammar_bitmask(logits, bitmask, rows, self.vocab_size)
        return rows


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Mask ``logits`` ``[B, V]`` in place: row ``rows[i]`` keeps only the tokens allowed by
    ``bitmask[i]`` (``[len(rows), ceil(vocab_size / 32)]`` int32, one bit per token)."""
    import xgrammar as xgr

    width = min(vocab_size, logits.shape[-1])
    if logits.device.type != "cpu":
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), vocab_size=width, indices=rows)
        return
    index = torch.tensor(rows, dtype=torch.int64)
    selected = logits[index].float()  # the CPU kernel takes float32 only
    xgr.apply_token_bitmask_inplace(selected, bitmask, vocab_size=width)
    logits[index] = selected.to(logits.dtype)
