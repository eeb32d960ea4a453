"""Samplers that reshape the distribution without truncating it: quadratic smoothing and skew."""

from __future__ import annotations

import torch


def apply_quadratic(logits: torch.Tensor, factor: torch.Tensor, curve: torch.Tensor) -> torch.Tensor:
    """Quadratic (smoothing) sampling, kalomaze's definition with the smoothing curve.

    With ``d = logit - max``: ``logit' = max - k * f * d**2 + s * f * d**3``, where
    ``k = (3 - curve) / 2`` and ``s = (curve - 1) / 2``; -inf stays -inf.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    diff = logits - max_logits
    factor, curve = factor.unsqueeze(1), curve.unsqueeze(1)
    k, s = (3.0 - curve) / 2.0, (curve - 1.0) / 2.0
    transformed = max_logits - k * factor * diff**2 + s * factor * diff**3
    # huge factors or curves overflow: a term of 0 * inf or inf - inf is NaN. The row's maximum
    # keeps its logit, a NaN elsewhere falls to -inf and +inf to the largest float, so the row
    # always has a finite logit and a softmax of no NaN
    transformed = torch.where(diff == 0, max_logits, transformed).nan_to_num(nan=-torch.inf, posinf=torch.finfo(logits.dtype).max)
    return torch.where(torch.isfinite(logits), transformed, logits)


def apply_skew(probs: torch.Tensor, skew: torch.Tensor) -> torch.Tensor:
    """Skew the distribution: with C the cumulative probability over tokens sorted by descending
    probability, the new probabilities are the increments of ``C ** exp(skew)``. Positive skew
    moves mass toward less likely tokens, negative toward the likely ones; zeros stay zero."""
    # float64: increments of values near 1 lose the tail in float32
    sorted_probs, order = probs.double().sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    cumulative = (cumulative / cumulative[:, -1:]).pow(skew.double().exp().unsqueeze(1))
    skewed = torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[:, :1])).clamp(min=0.0)
    skewed = torch.where(sorted_probs > 0, skewed, 0.0)
    skewed = skewed / skewed.sum(dim=-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, skewed.to(probs.dtype))
