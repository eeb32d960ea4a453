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


TOKEN_BYTES = 4  # token ids are searched as int32 bytes


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``token_ids`` between ``max_n`` and ``min_n`` tokens long; empty when no suffix of
    ``min_n`` tokens occurs earlier.

    :param token_ids: the whole sequence, ``[L]`` integers.
    """
    return lookup_in_bytes(np.ascontiguousarray(token_ids, dtype=np.int32).tobytes(), len(token_ids), min_n, max_n, k)


def lookup_in_bytes(data: bytes | bytearray, length: int, min_n: int, max_n: int, k: int) -> list[int]:
    """:func:`ngram_lookup` over a sequence held as ``length`` int32 values in ``data``: the
    suffixes, longest first, are searched backwards in C (``rfind``), so the most recent
    occurrence of the longest one that recurs is the first found."""
    if length < min_n + 1:
        return []
    limit = (length - 1) * TOKEN_BYTES  # an occurrence ends before the last token (which is the suffix's own end)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * TOKEN_BYTES : length * TOKEN_BYTES]
        found = data.rfind(pattern, 0, limit)
        while found > 0 and found % TOKEN_BYTES:  # a byte match across token boundaries: look further back
            found = data.rfind(pattern, 0, found + len(pattern) - 1)
        if found >= 0:
            start = found // TOKEN_BYTES + n  # the token after the occurrence
            stop = min(start + k, length)
            return np.frombuffer(bytes(data[start * TOKEN_BYTES : stop * TOKEN_BYTES]), dtype=np.int32).tolist()
    return []


def ngram_lookup_on_device(tokens: torch.Tensor, length: torch.Tensor, min_n: int, max_n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ngram_lookup` as device operations only (no value read back): ``tokens`` (int64
    ``[C]``) holds the sequence in its first ``length`` entries (0-d int64). Returns
    ``(drafts [k], count)``, the drafts zero past ``count``.

    Every earlier position ``e`` is scored at once by how many tokens up to it match the
    sequence's ending (at most ``max_n``); the highest score of at least ``min_n`` wins, the
    latest position among equals: the longest suffix that recurs, at its latest occurrence."""
    capacity, device = tokens.shape[0], tokens.device
    back = torch.arange(max_n, device=device)
    ends = torch.arange(capacity, device=device)
    suffix_at = length - 1 - back  # [max_n]: the ending, last token first
    suffix = tokens.gather(0, suffix_at.clamp(min=0))
    earlier = ends[None, :] - back[:, None]  # [max_n, C]: the tokens before each candidate end
    same = (tokens[earlier.clamp(min=0)] == suffix[:, None]) & (earlier >= 0) & (suffix_at >= 0)[:, None]
    matched = same.long().cumprod(0).sum(0)  # [C]: tokens matched backwards from each end
    usable = (ends <= length - 2) & (matched >= min_n)  # an occurrence ends before the last token
    score = torch.where(usable, matched * capacity + ends, -1)
    best = score.argmax()
    start = best + 1  # the token after the occurrence
    count = torch.where(score.max() >= 0, (length - start).clamp(0, k), 0)
    offsets = torch.arange(k, device=device)
    drafts = tokens.gather(0, (start + offsets).clamp(max=capacity - 1))
    return torch.where(offsets < count, drafts, 0), count


def lookup_bounds(config: SpeculativeConfig) -> tuple[int, int]:
    """``(prompt_lookup_min, prompt_lookup_max)`` with the defaults filled in."""
    min_n = DEFAULT_PROMPT_LOOKUP_MIN if config.prompt_lookup_min is None else config.prompt_lookup_min
    max_n = max(DEFAULT_PROMPT_LOOKUP_MAX, min_n) if config.prompt_lookup_max is None else config.prompt_lookup_max
    return min_n, max_n


class NgramProposer(Proposer):
    """Prompt-lookup drafts (``speculative_config={"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 1, "prompt_lookup_max": 3}``); host work only, no device memory."""

    drafts_between_passes = True
    drafts_on_device = True

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.check_config(config)
        self.min_n, self.max_n = lookup_bounds(config)
        self._buffers: dict[str, tuple[bytearray, int]] = {}  # request -> (its tokens as int32 bytes, how many)

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
            lookup_in_bytes(*self._sequence(req_id, token_ids), self.min_n, self.max_n, k)
            for req_id, token_ids in zip(inputs.req_ids, inputs.token_ids)
        ]
        return DraftTokens(req_ids=list(inputs.req_ids), token_ids=drafts)

    def propose_on_device(self, tokens: torch.Tensor, length: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The lookup of ``propose`` over a sequence on the device (``ngram_lookup_on_device``)."""
        return ngram_lookup_on_device(tokens, length, self.min_n, self.max_n, k)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Forget the sequences of finished (or preempted) requests."""
        for req_id in req_ids:
            self._buffers.pop(req_id, None)

    def _sequence(self, req_id: str, token_ids: list[int]) -> tuple[bytearray, int]:
        """The request's tokens as int32 bytes, kept between steps and grown by the new tokens
        only (converting a whole long sequence every step would cost more than the lookup)."""
        buffer, length = self._buffers.get(req_id, (None, 0))
        total = len(token_ids)
        if buffer is None or total < length:
            buffer, length = bytearray(), 0
        if total > length:
            buffer += np.asarray(token_ids[length:total], dtype=np.int32).tobytes()
        self._buffers[req_id] = (buffer, total)
        return buffer, total
