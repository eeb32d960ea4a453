"""The batched token mask: one call fills the allowed-token bitmask of every constrained row,
one call applies it to the logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from sonar.structured_output.matcher import RequestGrammar


class GrammarBitmask:
    """Masks the logits of a batch's constrained rows (their disallowed tokens become -inf).

    Keeps one host bitmask buffer, grown to the largest batch seen, and fills it with
    xgrammar's batch matcher on its own threads.

    :param vocab_size: the model's logits width.
    :param num_threads: threads that fill bitmasks (``"auto"``: xgrammar decides).
    """

    def __init__(self, vocab_size: int, num_threads: int | str = "auto") -> None:
        self.vocab_size = vocab_size
        self._batch_matcher = xgr.BatchGrammarMatcher(num_threads)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(vocab / 32)] int32

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """Mask ``logits`` ``[B, V]`` in place; row ``i`` follows ``grammars[i]`` (None: free).
        Returns the rows that were masked."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None and grammar.active]
        if not rows:
            return rows
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bitmask, indices=rows)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(self.vocab_size, logits.shape[-1]), indices=rows)
        else:  # the CPU kernel takes float32 only
            selected = logits[rows].float()
            xgr.apply_token_bitmask_inplace(selected, bitmask[rows], vocab_size=min(self.vocab_size, logits.shape[-1]))
            logits[rows] = selected.to(logits.dtype)
        return rows
