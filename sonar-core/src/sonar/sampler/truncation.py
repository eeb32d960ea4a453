"""Truncation samplers that set unlikely tokens to -inf: top-a, tail-free, typical-p, eta and
epsilon cutoff, and top-nσ. Each takes ``[R, V]`` logits and per-row ``[R]`` options.

A row keeps at least its most likely token under every one of them (typical-p: its most
typical token).
"""

from __future__ import annotations

import torch

from sonar.sampler.temperature import entropy

_NEG_INF = float("-inf")


def _remove_keeping_top(logits: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    remove.scatter_(1, logits.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill_(remove, _NEG_INF)


def apply_top_a(logits: torch.Tensor, top_a: torch.Tensor) -> torch.Tensor:
    """Top-a: drop tokens with ``p < top_a * p_max ** 2``."""
    probs = logits.softmax(dim=-1)
    p_max = probs.amax(dim=-1, keepdim=True)
    return _remove_keeping_top(logits, probs < top_a.unsqueeze(1) * p_max * p_max)


def apply_tfs(logits: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Tail-free sampling (Bricken), as KoboldAI and Aphrodite run it.

    Sort probabilities descending, take the absolute second differences, normalise them to sum
    to 1 and accumulate; sorted token j >= 1 is dropped when the sum up to difference j-1
    exceeds z, and the last sorted token always is.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    d2 = sorted_logits.softmax(dim=-1).diff(dim=-1).diff(dim=-1).abs()  # [R, V-2]
    total = d2.sum(dim=-1, keepdim=True)
    cdf = (d2 / total.clamp(min=1e-30)).cumsum(dim=-1)
    tail = cdf > z.unsqueeze(1)
    first = torch.zeros_like(tail[:, :1])
    remove_sorted = torch.cat([first, tail, ~first], dim=-1)  # [R, V]
    remove_sorted &= total > 0  # a flat row (no curvature) keeps everything
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return _remove_keeping_top(logits, remove)


def apply_typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al.): rank tokens by ``|-log p - H|`` ascending and
    keep the smallest prefix whose probability reaches ``mass``."""
    logprobs = torch.log_softmax(logits, dim=-1)
    shift = (-logprobs - entropy(logits).unsqueeze(1)).abs()  # inf for p = 0
    sorted_shift, order = shift.sort(dim=-1)
    cumulative = logprobs.exp().gather(1, order).cumsum(dim=-1)
    last = (cumulative < mass.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(max=logits.shape[1] - 1)
    positions = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(positions > last).scatter_(1, order, positions > last)
    return logits.masked_fill_(remove, _NEG_INF)  # the most typical token always stays


def apply_eta_cutoff(logits: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """Eta sampling (Hewitt et al.): drop ``p < min(eta, sqrt(eta) * exp(-H))``;
    ``eta`` in units of 1e-4."""
    eta = (eta * 1e-4).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    threshold = torch.minimum(eta, eta.sqrt() * torch.exp(-entropy(logits)).unsqueeze(1))
    return _remove_keeping_top(logits, probs < threshold)


def apply_epsilon_cutoff(logits: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
    """Epsilon sampling: drop ``p < epsilon``; ``epsilon`` in units of 1e-4."""
    probs = logits.softmax(dim=-1)
    return _remove_keeping_top(logits, probs < (epsilon * 1e-4).unsqueeze(1))


def apply_top_nsigma(logits: torch.Tensor, nsigma: torch.Tensor) -> torch.Tensor:
    """Top-nσ (Tang et al.): drop logits below ``max - n * σ``, σ the standard deviation of the
    row's finite logits (so the kept set does not depend on temperature)."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).to(logits.dtype)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    variance = (torch.where(finite, logits - mean, 0.0) ** 2).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)
    threshold = logits.amax(dim=-1, keepdim=True) - nsigma.unsqueeze(1) * variance.sqrt()
    return _remove_keeping_top(logits, logits < threshold)
