"""Hard token constraints applied to every row first: min_tokens, logit_bias, bad_words and
allowed_token_ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState

_NEG_INF = float("-inf")


@dataclass(slots=True)
class AllowedTokens:
    index: torch.Tensor  # [R] int64 rows with an allow-list
    keep: torch.Tensor  # [R, V] bool


def _pairs(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not rows:
        return None
    return to_device(torch.tensor(rows, dtype=torch.int64), device), to_device(torch.tensor(ids, dtype=torch.int64), device)


def build_banned(
    states: list["RequestSamplingState"], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) to set to -inf: eos/stop ids before min_tokens, and the last token of each
    bad word whose earlier tokens end the context (a one-token bad word is always banned)."""
    rows: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        banned = list(state.min_tokens_blocked_ids())
        for word in state.params.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or _ends_with(state, prefix):
                banned.append(word[-1])
        for token_id in banned:
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
    return _pairs(rows, ids, device)


def _ends_with(state: "RequestSamplingState", prefix: list[int]) -> bool:
    output, n = state.output_token_ids, len(prefix)
    if len(output) >= n:
        return output[-n:] == prefix
    head = n - len(output)
    return len(state.prompt_token_ids) >= head and state.prompt_token_ids[-head:] + output == prefix


def build_logit_bias(
    states: list["RequestSamplingState"], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, state in enumerate(states):
        for token_id, bias in (state.params.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
                biases.append(bias)
    pairs = _pairs(rows, ids, device)
    if pairs is None:
        return None
    return pairs[0], pairs[1], to_device(torch.tensor(biases, dtype=torch.float32), device)


def build_allowed(states: list["RequestSamplingState"], vocab_size: int, device: torch.device) -> AllowedTokens | None:
    rows = [row for row, s in enumerate(states) if s.params.allowed_token_ids]
    if not rows:
        return None
    keep = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = [t for t in states[row].params.allowed_token_ids if 0 <= t < vocab_size]
        keep[i, ids] = True
    return AllowedTokens(index=to_device(torch.tensor(rows, dtype=torch.int64), device), keep=to_device(keep, device))


def apply_banned(logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Set the (row, token) pairs to -inf, in place."""
    rows, ids = banned
    logits[rows, ids] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Add each (row, token, bias) triple to the logits, in place."""
    rows, ids, values = bias
    logits.index_put_((rows, ids), values, accumulate=True)


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Set every token outside a row's allow-list to -inf, in place."""
    logits[allowed.index] = logits[allowed.index].masked_fill(~allowed.keep, _NEG_INF)
