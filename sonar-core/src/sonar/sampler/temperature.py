"""Temperature: static, or dynamic from the entropy of the distribution (DynaTemp)."""

from __future__ import annotations

import math

import torch

_MIN_TEMPERATURE = 1e-4


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature ``[R]``, in place."""
    return logits.div_(temperature.unsqueeze(1))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[R]`` Shannon entropy (nats) of each row's softmax; -inf logits count as probability 0."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return -torch.where(logprobs > -math.inf, logprobs.exp() * logprobs, 0.0).sum(dim=-1)


def apply_dynatemp(
    logits: torch.Tensor, min_temp: torch.Tensor, max_temp: torch.Tensor, exponent: torch.Tensor
) -> torch.Tensor:
    """Entropy-based dynamic temperature (kalomaze's DynaTemp), in place.

    ``T = min + (max - min) * (H / log(n)) ** exponent``, where H is the entropy of the row's
    distribution and n its number of finite logits; a confident row gets a low temperature.
    """
    num_finite = torch.isfinite(logits).sum(dim=-1).to(torch.float32)  # [R]
    max_entropy = torch.log(num_finite)
    normalized = torch.where(max_entropy > 0, entropy(logits) / max_entropy.clamp(min=1e-12), 0.0).clamp(0.0, 1.0)
    temperature = min_temp + (max_temp - min_temp) * normalized.pow(exponent)
    return logits.div_(temperature.clamp(min=_MIN_TEMPERATURE).unsqueeze(1))
