"""The n-gram proposer (prompt lookup): drafts the tokens that followed the latest earlier
occurrence of the sequence's own ending.

No model runs: for each request the longest suffix of ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens that also occurs earlier in its sequence (prompt and output) is
looked up, the most recent such occurrence wins, and the tokens after it are the drafts. It
pays off where outputs copy spans of the prompt (code edits, quoting, extraction).
"""

from __future__ import annotations

import numpy as np
import torch

from sonar.spec_decode.interface import DraftTokens, Proposer, ProposerInputs, SpeculativeConfig

DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 3


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``token_ids`` between ``max_n`` and ``min_n`` tokens long; empty when no suffix of
    ``min_n`` tokens occurs earlier.

    :param token_ids: the whole sequence, ``[L]`` integers.
    """
    length = len(token_ids)
    if length < min_n + 1:
        return []
    # candidate ends: earlier positions holding the last token (an end at length - 1 is the suffix itself)
    ends = np.flatnonzero(token_ids[: length - 1] == token_ids[length - 1])
    if len(ends) == 0:
        return []
    # how far back each candidate keeps agreeing with the suffix, up to max_n tokens
    match = np.ones(len(ends), dtype=np.int64)
    agreeing = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        starts = ends - back
        agreeing &= starts >= 0
        agreeing[agreeing] = token_ids[starts[agreeing]] == token_ids[length - 1 - back]
        if not agreeing.any():
            break
        match += agreeing
    best = int(match.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(match == best)[-1]])  # the most recent of the longest matches
    return token_ids[end + 1 : end + 1 + k].tolist()


def lookup_bounds(config: SpeculativeConfig) -> tuple[int, int]:
    """``(prompt_lookup_min, prompt_lookup_max)`` with the defaults filled in."""
    min_n = DEFAULT_PROMPT_LOOKUP_MIN if config.prompt_lookup_min is None else config.prompt_lookup_min
    max_n = max(DEFAULT_PROMPT_LOOKUP_MAX, min_n) if config.prompt_lookup_max is None else config.prompt_lookup_max
    return min_n, max_n


class NgramProposer(Proposer):
    """Prompt-lookup drafts (``speculative_config={"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 1, "prompt_lookup_max": 3}``); host work only, no device memory."""

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.check_config(config)
        self.min_n, self.max_n = lookup_bounds(config)
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request -> (its tokens, how many)

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """``prompt_lookup_min`` must be at least 1 and no more than ``prompt_lookup_max``."""
        min_n, max_n = lookup_bounds(config)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"speculative_config: prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})")

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Look each request's ending up in its own tokens."""
        k = self.config.num_speculative_tokens
        drafts = [
            ngram_lookup(self._sequence(req_id, token_ids), self.min_n, self.max_n, k)
            for req_id, token_ids in zip(inputs.req_ids, inputs.token_ids)
        ]
        return DraftTokens(req_ids=list(inputs.req_ids), token_ids=drafts)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Forget the sequences of finished (or preempted) requests."""
        for req_id in req_ids:
            self._buffers.pop(req_id, None)

    def _sequence(self, req_id: str, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as an array, kept between steps and grown by the new tokens
        only (converting a whole long sequence every step would cost more than the lookup)."""
        buffer, length = self._buffers.get(req_id, (None, 0))
        total = len(token_ids)
        if buffer is None or total < length:
            buffer, length = np.empty(max(2 * total, 64), dtype=np.int64), 0
        elif total > len(buffer):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:total] = token_ids[length:total]
        self._buffers[req_id] = (buffer, total)
        return buffer[:total]
