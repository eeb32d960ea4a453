"""What the drafter trainers share: shuffled mini-batches and the learning-rate schedule."""

from __future__ import annotations

import math
import random

import torch


def index_batches(count: int, size: int, rng: random.Random | None) -> list[list[int]]:
    """``range(count)`` in batches of ``size``, shuffled by ``rng`` where given."""
    order = list(range(count))
    if rng is not None:
        rng.shuffle(order)
    return [order[start : start + size] for start in range(0, count, size)]


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_divisor: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``total_steps // warmup_divisor`` steps (at least one), then cosine
    decay to zero at ``total_steps``."""
    warmup = max(1, total_steps // warmup_divisor)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
