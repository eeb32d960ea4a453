"""The draft distributions of proposed tokens, kept from the step that proposed them until the
step that verifies them, and laid out row for row beside the target's positions."""

from __future__ import annotations

import torch

from sonar.spec_decode.verifier import VerifyLayout


class DraftProbsStore:
    """Per request: the drafts last proposed with their distributions (``[k, V]``).

    The scheduler may verify fewer drafts than were proposed (a prefix: budget, ``max_tokens``)
    or none; an entry is used only where the verified drafts are a prefix of the stored ones,
    and it is used once.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[int], torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def store(self, req_id: str, token_ids: list[int], probs: torch.Tensor | None) -> None:
        """Keep ``probs`` of ``token_ids`` (None: they were drafted greedily, nothing to keep)."""
        if probs is None or not token_ids:
            self._entries.pop(req_id, None)
        else:
            self._entries[req_id] = (token_ids, probs)

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._entries.pop(req_id, None)

    def take_rows(self, req_ids: list[str], drafts: list[list[int]], layout: VerifyLayout, vocab_size: int) -> torch.Tensor | None:
        """``[P, V]`` the draft distribution at each verified position (None: no request of the
        step has one, every draft is one-hot). A request with drafts but no stored
        distribution gets one-hot rows at its drafts; bonus positions and requests without
        drafts get zero rows (never read)."""
        found = [self._entries.pop(req_id, None) for req_id in req_ids]
        if not any(entry is not None for entry in found):
            return None
        device = layout.draft_ids.device
        rows = torch.zeros(layout.num_positions, vocab_size, dtype=torch.float32, device=device)
        for i, (entry, tokens) in enumerate(zip(found, drafts)):
            if not tokens:
                continue
            start, count = layout.starts[i], len(tokens)
            if entry is not None and entry[0][:count] == tokens:
                probs = entry[1][:count]
                width = min(vocab_size, probs.shape[-1])
                rows[start : start + count, :width] = probs[:, :width]
            else:
                rows[start : start + count].scatter_(1, layout.draft_ids[start : start + count, None], 1.0)
        return rows
