"""XTC, "exclude top choices" (p-e-w): with some probability per step, remove every token whose
probability is at least the threshold except the least likely of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.sampler.rows import RowValues, row_uniforms

_NEG_INF = float("-inf")


@dataclass(slots=True)
class XtcTensors:
    values: RowValues  # (threshold, probability) per row using XTC
    generators: list[torch.Generator | None]  # aligned with values.rows; the coin comes from it


def apply_xtc(logits: torch.Tensor, threshold: torch.Tensor, probability: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` logits; ``coins`` ``[R]`` uniform draws: a row applies XTC when coin < probability.

    Nothing is removed unless at least two tokens reach the threshold.
    """
    probs = logits.softmax(dim=-1)
    above = probs >= threshold.unsqueeze(1)
    least_above = torch.where(above, probs, 2.0).amin(dim=-1, keepdim=True)  # [R, 1]
    remove = above & (probs > least_above) & (coins < probability).unsqueeze(1)
    return logits.masked_fill_(remove, _NEG_INF)


def run_xtc(logits: torch.Tensor, xtc: XtcTensors) -> torch.Tensor:
    coins = row_uniforms(xtc.generators, logits.device)
    threshold, probability = xtc.values.values
    return xtc.values.apply(logits, lambda sub, *_: apply_xtc(sub, threshold, probability, coins))
