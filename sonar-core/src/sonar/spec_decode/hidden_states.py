"""The target's hidden states a proposer reads (EAGLE-style drafters): kept from each step's
forward pass, cut to the positions that stay, and handed over once per request.

A request's positions reach the proposer exactly once, in order: a prefill chunk that samples
nothing is held here until the request's next proposal; a verify step hands over only the
positions whose input token was kept (its last known token and the accepted drafts), since
the states after a rejected draft were computed from a wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar.worker.input_batch import StepBatch


@dataclass(slots=True)
class StepHiddenStates:
    """One step's states on the device and where each sampled request's rows are.

    ``rows[req_id] = (first row, rows computed, drafts among them)``.
    """

    states: torch.Tensor  # [num_tokens, width]
    positions: torch.Tensor  # [num_tokens]
    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class ProposerHiddenStates:
    """What a proposal gets: ``counts[i]`` rows of ``states``/``positions`` per request, in order."""

    states: torch.Tensor  # [sum(counts), width]
    positions: torch.Tensor  # [sum(counts)]
    counts: list[int]


class HiddenStateCollector:
    """Keeps the states of prefill chunks that sampled nothing until their request's next
    proposal, and cuts verify steps down to their kept positions."""

    def __init__(self) -> None:
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(self, batch: StepBatch, states: torch.Tensor) -> StepHiddenStates:
        """The step's states (``[num_tokens, width]``, rows as ``batch`` lays out tokens)."""
        step = StepHiddenStates(states, batch.positions)
        qsl = batch.attn_metadata.query_start_loc_cpu
        drafts = batch.sample_drafts
        num_drafts = {row: len(drafts[i]) if drafts is not None else 0 for i, row in enumerate(batch.sample_rows)}
        for row, state in enumerate(batch.states):
            start, count = int(qsl[row]), batch.num_scheduled[row]
            if row in num_drafts:
                step.rows[state.req_id] = (start, count, num_drafts[row])
            else:  # a prefill chunk before the last: held for the request's next proposal
                rows = slice(start, start + count)
                self._pending.setdefault(state.req_id, []).append((states[rows].clone(), batch.positions[rows].clone()))
        return step

    def gather(self, step: StepHiddenStates, req_ids: list[str], num_accepted: list[int]) -> ProposerHiddenStates:
        """The states of ``req_ids`` not handed over yet: held chunks first, then the step's
        kept rows (``num_accepted[i]``: 1 + the drafts kept of request ``i``)."""
        states, positions, counts = [], [], []
        for req_id, accepted in zip(req_ids, num_accepted):
            start, count, drafts = step.rows[req_id]
            kept = count - drafts + (accepted - 1 if drafts else 0)
            pieces = self._pending.pop(req_id, [])
            pieces.append((step.states[start : start + kept], step.positions[start : start + kept]))
            states += [s for s, _ in pieces]
            positions += [p for _, p in pieces]
            counts.append(sum(len(p) for _, p in pieces))
        width = step.states.shape[-1]
        if not states:
            return ProposerHiddenStates(step.states.new_zeros(0, width), step.positions.new_zeros(0), [])
        return ProposerHiddenStates(torch.cat(states), torch.cat(positions), counts)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop what is held for finished or preempted requests."""
        for req_id in req_ids:
            self._pending.pop(req_id, None)
