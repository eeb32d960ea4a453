"""Truncation samplers: top-k, top-p (nucleus) and min-p, as in-place -inf masks on logits."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p set to -inf; may work in place.

    :param logits: ``[B, V]`` float32 (already temperature-scaled).
    :param top_k: ``[B]`` int64, V where off; None: no row uses top-k.
    :param max_top_k: the largest k among rows using top-k.
    :param top_p: ``[B]`` float32, 1.0 where off; None: no row uses top-p.
    :returns: the masked logits (``logits`` itself or a new tensor).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    if top_p is None:
        # top-k alone: a partial sort up to the largest k is enough
        assert top_k is not None
        top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k]
        kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [B, 1]
        threshold = torch.where((top_k < vocab_size).unsqueeze(1), kth, _NEG_INF)
        return logits.masked_fill_(logits < threshold, _NEG_INF)

    if top_k is None and logits.device.type == "cpu" and vocab_size > 4 * TOP_P_CANDIDATES:
        return _top_p_from_candidates(logits, top_p)
    return _top_k_top_p_by_sort(logits, top_k, top_p)


# On the CPU a full sort of the vocabulary dominates a step's sampling; the nucleus nearly
# always lies within the most likely few hundred tokens, so top-p looks there first.
TOP_P_CANDIDATES = 1024


def _top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top-p from a partial sort: rows whose nucleus fits in the top ``TOP_P_CANDIDATES`` tokens
    are masked from those; the others (flat distributions) fall back to the full sort."""
    probs = logits.softmax(dim=-1)
    top_probs, top_ids = probs.topk(TOP_P_CANDIDATES, dim=-1)  # [B, C], descending
    mass_above = top_probs.cumsum(dim=-1) - top_probs  # probability strictly more likely
    threshold = top_p.unsqueeze(1)
    keep = mass_above < threshold
    keep[:, 0] = True  # the most likely token always stays
    off = top_p >= 1.0
    fits = off | (mass_above[:, -1] + top_probs[:, -1] >= top_p)
    drop = torch.ones_like(logits, dtype=torch.bool)
    drop.scatter_(1, top_ids, ~keep)
    drop[off] = False
    if not bool(fits.all()):
        rows = (~fits).nonzero().squeeze(1)
        logits[rows] = _top_k_top_p_by_sort(logits[rows], None, top_p[rows])
        drop[rows] = False
    return logits.masked_fill_(drop, _NEG_INF)


def _top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    # one ascending sort serves both
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [B, V], ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    # drop a token when it and everything below it hold at most 1 - top_p of the mass
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the top probability, in place.

    Works on logits: ``p_i < min_p * p_max`` iff ``logit_i < logit_max + log(min_p)``.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    threshold = max_logits + torch.log(min_p).unsqueeze(1)  # log(0) = -inf: row unaffected
    return logits.masked_fill_(logits < threshold, _NEG_INF)
