"""Small building blocks shared by the decoder models."""

from __future__ import annotations

import torch
from torch import nn

from sonar import ops


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Hugging Face does).

    Runs through ``sonar.ops``, so a platform's fused kernel replaces it where registered.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual``; returns ``(norm(residual), residual)`` (may reuse the inputs' memory)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """``nn.Linear`` through ``sonar.ops.linear``, so a platform's kernel serves the shapes it
    does better (same parameters and state-dict names as ``nn.Linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """A Linear whose output rows are several checkpoint projections stacked in order
    (``{"q": 576, "k": 192, "v": 192}``); the weight loader fills each part separately."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def part_rows(self, part: str) -> slice:
        """The output rows that hold ``part``."""
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(f"{part!r} is not one of this layer's parts {list(self.parts)}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2 * intermediate]`` input (through ``sonar.ops``)."""
    return ops.silu_and_mul(gate_up)
