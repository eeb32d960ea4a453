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
    """(rows, ids) to set to -inf: each state's ``banned_ids`` inside the vocabulary."""
    rows: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        for token_id in state.banned_ids():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
    return _pairs(rows, ids, device)


def build_logit_bias(
    states: list["RequestSamplingState"], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, ids, biases) of every row's ``logit_bias`` inside the vocabulary."""
    parts = [(row, *state.logit_bias_tensors(vocab_size)) for row, state in enumerate(states) if state.params.logit_bias]
    parts = [part for part in parts if part[1].numel()]
    if not parts:
        return None
    rows = torch.cat([torch.full((ids.numel(),), row, dtype=torch.int64) for row, ids, _ in parts])
    ids = torch.cat([ids for _, ids, _ in parts])
    biases = torch.cat([biases for _, _, biases in parts])
    return to_device(rows, device), to_device(ids, device), to_device(biases, device)


def build_allowed(states: list["RequestSamplingState"], vocab_size: int, device: torch.device) -> AllowedTokens | None:
    rows = [row for row, s in enumerate(states) if s.params.allowed_token_ids]
    if not rows:
        return None
    keep = torch.stack([states[row].allowed_mask(vocab_size) for row in rows])
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
