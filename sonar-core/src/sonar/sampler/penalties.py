"""Logit edits before sampling: min_tokens masking, logit_bias, repetition/presence/frequency."""

from __future__ import annotations

import torch

from sonar.sampler.metadata import PenaltyTensors


def apply_min_tokens_mask(logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Set the (row, token) pairs in ``mask`` to -inf, in place."""
    rows, ids = mask
    logits[rows, ids] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Add each (row, token, bias) triple to the logits, in place."""
    rows, ids, values = bias
    logits.index_put_((rows, ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply penalties in place.

    Repetition (HF/CTRL): every token seen in prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. Presence and frequency (OpenAI), over the
    output only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    if penalties.repetition is not None and penalties.seen_mask is not None:
        # [B, V] factor: penalty on seen tokens, 1 elsewhere
        factor = torch.where(penalties.seen_mask, penalties.repetition.unsqueeze(1), 1.0)
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    if penalties.output_counts is not None:
        counts = penalties.output_counts  # [B, V]
        logits -= penalties.frequency.unsqueeze(1) * counts
        logits -= penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
