"""Penalties on tokens already seen: repetition (with Kobold's range and slope), presence and
frequency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState


@dataclass(slots=True)
class PenaltyTensors:
    repetition: torch.Tensor | None  # [B, V] float32 factor: the penalty on seen tokens, 1 elsewhere
    presence: torch.Tensor | None  # [B] float32; None: no row uses presence/frequency
    frequency: torch.Tensor | None  # [B] float32
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far


def occurrence_counts(
    token_lists: list[torch.Tensor], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[B, V]`` float32 counts of each token id per row (ids outside the vocab dropped)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    ids = to_device(torch.cat(token_lists), device) if token_lists else torch.empty(0, dtype=torch.int64, device=device)
    rows = to_device(torch.repeat_interleave(torch.arange(num_rows), lengths), device)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # overflow column
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts[:, :vocab_size]


def context_ids(state: "RequestSamplingState", last: int = 0) -> torch.Tensor:
    """``[L]`` int64 CPU: prompt then output ids; only the ``last`` ones when ``last`` > 0."""
    output = torch.tensor(state.output_token_ids, dtype=torch.int64)
    context = torch.cat([state.prompt_ids_cpu(), output])
    return context[-last:] if last > 0 else context


def build_penalties(
    states: list["RequestSamplingState"], vocab_size: int, device: torch.device
) -> PenaltyTensors | None:
    params = [s.params for s in states]
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (use_repetition or use_additive):
        return None
    num_rows = len(states)
    outputs = [torch.tensor(s.output_token_ids, dtype=torch.int64) for s in states]
    output_counts = occurrence_counts(outputs, num_rows, vocab_size, device) if use_additive else None

    def floats(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)

    return PenaltyTensors(
        repetition=_repetition_factor(states, vocab_size, device) if use_repetition else None,
        presence=floats([p.presence_penalty for p in params]) if use_additive else None,
        frequency=floats([p.frequency_penalty for p in params]) if use_additive else None,
        output_counts=output_counts,
    )


def _repetition_factor(states: list["RequestSamplingState"], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]``: the repetition penalty of each seen token, 1 for the others.

    Over the last ``repetition_penalty_range`` context tokens (all when 0); with a slope, the
    older half of that window (Kobold's "far" tokens) gets ``1 + (penalty - 1) * slope``.
    """
    near_lists: list[torch.Tensor] = []
    far_lists: list[torch.Tensor] = []
    near_penalty: list[float] = []
    far_penalty: list[float] = []
    empty = torch.empty(0, dtype=torch.int64)
    for state in states:
        p = state.params
        if p.repetition_penalty == 1.0:
            near_lists.append(empty)
            far_lists.append(empty)
        else:
            window = context_ids(state, p.repetition_penalty_range)
            num_far = len(window) // 2 if p.repetition_penalty_slope != 1.0 else 0
            far_lists.append(window[:num_far])
            near_lists.append(window[num_far:])
        near_penalty.append(p.repetition_penalty)
        reduced = 1.0 + (p.repetition_penalty - 1.0) * p.repetition_penalty_slope
        far_penalty.append(reduced if p.repetition_penalty > 1.0 else p.repetition_penalty)
    num_rows = len(states)
    near = occurrence_counts(near_lists, num_rows, vocab_size, device) > 0  # [B, V]
    factor = torch.where(near, torch.tensor(near_penalty, device=device).unsqueeze(1), 1.0)
    if any(len(t) for t in far_lists):
        far = (occurrence_counts(far_lists, num_rows, vocab_size, device) > 0) & ~near
        factor = torch.where(far, torch.tensor(far_penalty, device=device).unsqueeze(1), factor)
    return factor


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Apply penalties in place.

    Repetition (HF/CTRL): every token seen in the window has a positive logit divided by its
    penalty and a negative one multiplied by it. Presence and frequency (OpenAI), over the
    output only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    if penalties.repetition is not None:
        factor = penalties.repetition  # [B, V]
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    if penalties.output_counts is not None:
        counts = penalties.output_counts  # [B, V]
        logits -= penalties.frequency.unsqueeze(1) * counts
        logits -= penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits
