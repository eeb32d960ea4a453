"""Repetition samplers over the context: DRY ("Don't Repeat Yourself") and no-repeat-ngram.

Both ask, for every earlier position i of a row's context, how long the run of tokens ending
at i is that also ends the context: the token after i would extend that repetition. One
batched suffix match serves both (``suffix_match_lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sonar.sampler.penalties import context_ids
from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState

_PAD = -1
# matches longer than allowed_length + this are penalised as if this long (DRY's penalty is
# already beyond any logit there: 1.75 ** 64 ~ 4e15)
DRY_MAX_EXTRA_MATCH = 64


@dataclass(slots=True)
class ContextTensors:
    """The contexts of R rows, right-aligned: ``[R, L]`` ids, left-padded; column 0 is always padding."""

    rows: list[int]
    index: torch.Tensor | None  # [R] int64 batch rows; None: every row
    ids: torch.Tensor  # [R, L] int64, padding = -1
    stop: torch.Tensor  # [R, L] bool: padding or a sequence breaker (matching stops there)


@dataclass(slots=True)
class DryTensors:
    context: ContextTensors
    multiplier: torch.Tensor  # [R] float32
    base: torch.Tensor  # [R] float32
    allowed_length: torch.Tensor  # [R] int64
    max_match: int  # cap on the match length


@dataclass(slots=True)
class NgramTensors:
    context: ContextTensors
    size: torch.Tensor  # [R] int64 n-gram size
    max_size: int


def _contexts(
    states: list["RequestSamplingState"], rows: list[int], ranges: list[int], num_states: int,
    breakers: torch.Tensor | None, vocab_size: int, device: torch.device,
) -> ContextTensors:  # fmt: skip
    """``breakers``: ``[R, V + 1]`` bool, each row's sequence breakers (the last column,
    padding and ids outside the vocabulary, False); None: no row has any."""
    windows = [context_ids(states[row], last) for row, last in zip(rows, ranges)]
    length = max(len(w) for w in windows) + 1
    ids = torch.full((len(rows), length), _PAD, dtype=torch.int64)
    for i, window in enumerate(windows):
        if len(window):
            ids[i, length - len(window) :] = window
    stop = ids < 0
    if breakers is not None:
        safe = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # the overflow column V catches padding and foreign ids
        stop |= breakers.gather(1, safe)
    index = None if len(rows) == num_states else to_device(torch.tensor(rows, dtype=torch.int64), device)
    return ContextTensors(rows=rows, index=index, ids=to_device(ids, device), stop=to_device(stop, device))


def build_dry(states: list["RequestSamplingState"], rows: list[int], vocab_size: int, device: torch.device) -> DryTensors:
    """DRY's tensors for ``rows`` (those with ``dry_multiplier > 0``)."""
    params = [states[row].params for row in rows]
    # each request's breakers as a cached row (it may list a whole vocabulary: per step a copy, not a walk)
    breakers = torch.stack([states[row].dry_breaker_mask(vocab_size) for row in rows]) if any(p.dry_sequence_breaker_ids for p in params) else None
    context = _contexts(states, rows, [p.dry_range for p in params], len(states), breakers, vocab_size, device)
    allowed = [p.dry_allowed_length for p in params]
    return DryTensors(
        context=context,
        multiplier=to_device(torch.tensor([p.dry_multiplier for p in params], dtype=torch.float32), device),
        base=to_device(torch.tensor([p.dry_base for p in params], dtype=torch.float32), device),
        allowed_length=to_device(torch.tensor(allowed, dtype=torch.int64), device),
        max_match=max(max(allowed), 1) + DRY_MAX_EXTRA_MATCH,
    )


def build_no_repeat_ngram(
    states: list["RequestSamplingState"], rows: list[int], vocab_size: int, device: torch.device
) -> NgramTensors:
    """No-repeat-ngram's tensors for ``rows`` (those with ``no_repeat_ngram_size > 0``)."""
    sizes = [states[row].params.no_repeat_ngram_size for row in rows]
    context = _contexts(states, rows, [0] * len(rows), len(states), None, vocab_size, device)
    return NgramTensors(
        context=context, size=to_device(torch.tensor(sizes, dtype=torch.int64), device), max_size=max(sizes)
    )


def suffix_match_lengths(ids: torch.Tensor, stop: torch.Tensor, max_length: int) -> torch.Tensor:
    """``[R, L-1]`` int64: for each position i < L-1, the largest n <= ``max_length`` with
    ``ids[i-n+1 .. i] == ids[L-n .. L-1]`` and no stop position among ``ids[i-n+1 .. i]``.

    :param ids: ``[R, L]`` right-aligned context ids (column 0 padding).
    :param stop: ``[R, L]`` bool, True at padding and sequence breakers.
    """
    num_rows, length = ids.shape
    lengths = torch.zeros(num_rows, length - 1, dtype=torch.int64, device=ids.device)
    alive = torch.ones(num_rows, length - 1, dtype=torch.bool, device=ids.device)
    for k in range(min(max_length, length - 1)):
        # position i - k for i = k .. L-2, against the context's (k+1)-th token from the end
        earlier = ids[:, : length - 1 - k]
        match = (earlier == ids[:, length - 1 - k : length - k]) & ~stop[:, : length - 1 - k]
        alive[:, :k] = False
        alive[:, k:] &= match
        lengths += alive
        if k % 4 == 3 and not bool(alive.any()):
            break
    return lengths


def apply_dry(logits: torch.Tensor, dry: DryTensors) -> torch.Tensor:
    """Subtract ``multiplier * base ** (n - allowed_length)`` from every token that would extend
    a repetition of n >= allowed_length tokens (n is the longest such match in the window).

    p-e-w's definition: matching does not cross sequence breakers, a breaker as the last context
    token turns DRY off for the step, and a breaker is never penalised.
    """
    context = dry.context
    sub = logits if context.index is None else logits[context.index]
    vocab_size = sub.shape[1]
    lengths = suffix_match_lengths(context.ids, context.stop, dry.max_match)  # [R, L-1]
    candidates = context.ids[:, 1:]  # the token after each position
    allowed = dry.allowed_length.unsqueeze(1)
    lengths = torch.where((lengths >= allowed.clamp(min=1)) & ~context.stop[:, 1:], lengths, 0)
    safe = torch.where(candidates >= 0, candidates, vocab_size)
    longest = torch.zeros(sub.shape[0], vocab_size + 1, dtype=torch.int64, device=sub.device)
    longest.scatter_reduce_(1, safe, lengths, reduce="amax")
    longest = longest[:, :vocab_size]  # [R, V]
    exponent = (longest - allowed).to(torch.float32)
    penalty = dry.multiplier.unsqueeze(1) * dry.base.unsqueeze(1).pow(exponent)
    sub = sub - torch.where(longest > 0, penalty, 0.0)
    if context.index is None:
        return sub
    logits[context.index] = sub
    return logits


def apply_no_repeat_ngram(logits: torch.Tensor, ngram: NgramTensors) -> torch.Tensor:
    """Ban (-inf) every token that would complete an n-gram already in the context (HF's
    ``no_repeat_ngram_size``, over prompt and output)."""
    context = ngram.context
    sub = logits if context.index is None else logits[context.index]
    vocab_size = sub.shape[1]
    lengths = suffix_match_lengths(context.ids, context.stop, ngram.max_size - 1)  # [R, L-1]
    candidates = context.ids[:, 1:]
    banned = (lengths >= (ngram.size - 1).unsqueeze(1)) & (candidates >= 0)
    safe = torch.where(banned, candidates, vocab_size)
    mask = torch.zeros(sub.shape[0], vocab_size + 1, dtype=torch.bool, device=sub.device)
    mask.scatter_(1, safe, True)
    sub = sub.masked_fill(mask[:, :vocab_size], float("-inf"))
    if context.index is None:
        return sub
    logits[context.index] = sub
    return logits
