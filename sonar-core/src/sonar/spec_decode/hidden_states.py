"""The target's hidden states a proposer reads (EAGLE-style drafters): kept from each step's
forward pass, cut to the positions that stay, and handed over once per request.

A request's positions reach the proposer exactly once, in order: a prefill chunk that samples
nothing is held here until the request's next proposal; a verify step hands over only the
positions whose input token was kept (its last known token and the accepted drafts), since
the states after a rejected draft were computed from a wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sonar.tensors import to_device
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


#: steps without drafts whose states are held, then handed to the proposer together
HOLD_STEPS = 16


class HiddenStateCollector:
    """Keeps the states of prefill chunks that sampled nothing until their request's next
    proposal, holds those of steps without drafts (``hold``), and cuts verify steps down to
    their kept positions."""

    def __init__(self) -> None:
        # per request, its rows not handed over yet, oldest first: (states, positions, first row, rows)
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
        self._held_steps = 0

    def record(self, batch: StepBatch, states: torch.Tensor) -> StepHiddenStates:
        """The step's states (``[num_tokens, width]``, rows as ``batch`` lays out tokens).

        The positions are copied: a runner may build the next step's inputs into the same
        buffers while this step's states are still held."""
        step = StepHiddenStates(states, batch.positions.clone())
        starts = batch.token_starts()
        drafts = batch.sample_drafts
        num_drafts = {row: len(drafts[i]) if drafts is not None else 0 for i, row in enumerate(batch.sample_rows)}
        for row, state in enumerate(batch.states):
            start, count = starts[row], batch.num_scheduled[row]
            if row in num_drafts:
                step.rows[state.req_id] = (start, count, num_drafts[row])
            else:  # a prefill chunk before the last: held (its rows only) for the request's next proposal
                rows = slice(start, start + count)
                self._pending.setdefault(state.req_id, []).append((states[rows].clone(), step.positions[rows].clone(), 0, count))
        return step

    @staticmethod
    def _kept(step: StepHiddenStates, req_id: str, accepted: int) -> tuple[int, int]:
        """The request's first row in the step and how many rows stay (its rows up to the last
        accepted draft)."""
        start, count, drafts = step.rows[req_id]
        return start, count - drafts + (accepted - 1 if drafts else 0)

    def hold(self, step: StepHiddenStates, req_ids: list[str], num_accepted: list[int]) -> bool:
        """Hold the step's kept rows of ``req_ids`` (a step without drafts to follow) for their
        next ``gather``, so that one hand-over takes several steps' states: True if held;
        False once ``HOLD_STEPS - 1`` steps are held (gather this one with them now). The
        step's states are referenced, not copied."""
        if self._held_steps >= HOLD_STEPS - 1:
            return False
        for req_id, accepted in zip(req_ids, num_accepted):
            start, kept = self._kept(step, req_id, accepted)
            if kept:
                self._pending.setdefault(req_id, []).append((step.states, step.positions, start, kept))
        self._held_steps += 1
        return True

    def gather(self, step: StepHiddenStates, req_ids: list[str], num_accepted: list[int]) -> ProposerHiddenStates:
        """The states of ``req_ids`` not handed over yet: held rows first, then the step's
        kept rows (``num_accepted[i]``: 1 + the drafts kept of request ``i``), as one slice
        of the step's states where they are contiguous there, else one gather."""
        self._held_steps = 0
        offset_of: dict[int, int] = {}  # id(states) -> its first row among the pooled tensors
        pooled: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = 0
        firsts: list[int] = []  # per piece, its first row in the pool
        lengths: list[int] = []  # per piece, its rows
        counts: list[int] = []
        for req_id, accepted in zip(req_ids, num_accepted):
            start, kept = self._kept(step, req_id, accepted)
            count = 0
            for states, positions, first, rows in [*self._pending.pop(req_id, ()), (step.states, step.positions, start, kept)]:
                offset = offset_of.get(id(states))
                if offset is None:
                    offset = offset_of[id(states)] = total
                    total += states.shape[0]
                    pooled.append((states, positions))
                firsts.append(offset + first)
                lengths.append(rows)
                count += rows
            counts.append(count)
        all_states = torch.cat([states for states, _ in pooled]) if len(pooled) > 1 else step.states
        all_positions = torch.cat([positions for _, positions in pooled]) if len(pooled) > 1 else step.positions
        sizes = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(sizes)
        num_rows = int(ends[-1]) if len(ends) else 0
        if not num_rows:
            return ProposerHiddenStates(all_states[:0], all_positions[:0], counts)
        index = np.arange(num_rows, dtype=np.int64) + np.repeat(np.asarray(firsts, dtype=np.int64) - (ends - sizes), sizes)
        if bool((np.diff(index) == 1).all()):
            rows = slice(int(index[0]), int(index[0]) + num_rows)  # contiguous: a view
            return ProposerHiddenStates(all_states[rows], all_positions[rows], counts)
        on_device = to_device(index, all_states.device)
        return ProposerHiddenStates(all_states.index_select(0, on_device), all_positions.index_select(0, on_device), counts)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop what is held for finished or preempted requests."""
        for req_id in req_ids:
            self._pending.pop(req_id, None)
