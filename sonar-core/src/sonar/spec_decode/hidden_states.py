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
    """One step's states on the device and where each sampled request's rows are: request
    ``req_ids[i]``'s first row, rows computed and drafts among them are ``starts[i]``,
    ``counts[i]`` and ``drafts[i]``."""

    states: torch.Tensor  # [num_tokens, width]
    positions: torch.Tensor  # [num_tokens]
    req_ids: list[str] = field(default_factory=list)  # the sampled requests, in row order
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _index: dict[str, int] | None = None  # req_id -> i, built when first needed

    def kept(self, req_ids: list[str], num_accepted: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per request of ``req_ids``, its first row and how many of its rows stay: its rows up
        to its last accepted draft (``num_accepted[i]``: 1 + the drafts kept)."""
        if req_ids == self.req_ids:  # most often: all of them, in order
            at = slice(None)
        else:
            if self._index is None:
                self._index = {req_id: i for i, req_id in enumerate(self.req_ids)}
            at = [self._index[r] for r in req_ids]
        drafts = self.drafts[at]
        accepted = np.asarray(num_accepted, dtype=np.int64)
        return self.starts[at], self.counts[at] - drafts + np.where(drafts > 0, accepted - 1, 0)


@dataclass(slots=True)
class ProposerHiddenStates:
    """What a proposal gets: ``counts[i]`` rows of ``states``/``positions`` per request, in order."""

    states: torch.Tensor  # [sum(counts), width]
    positions: torch.Tensor  # [sum(counts)]
    counts: list[int]


@dataclass(slots=True)
class _HeldStep:
    """A step without drafts to follow whose kept rows wait for a hand-over (``hold``)."""

    step: StepHiddenStates
    req_ids: list[str]
    starts: np.ndarray
    kept: np.ndarray
    gone: set[str] = field(default_factory=set)  # requests dropped since (their rows go nowhere)


#: steps without drafts whose states are held, then handed to the proposer together
HOLD_STEPS = 16


class HiddenStateCollector:
    """Keeps the states of prefill chunks that sampled nothing until their request's next
    proposal, holds those of steps without drafts (``hold``), and cuts verify steps down to
    their kept positions.

    The per-step work is a few array operations whatever the batch: a held step is kept
    whole, and a hand-over finds every request's rows at once."""

    def __init__(self) -> None:
        # per request, its rows not handed over yet that no held step holds, oldest first:
        # (states, positions, first row, rows): prefill chunks, and a held step's rows that a
        # hand-over for other requests left behind
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
        self._held: list[_HeldStep] = []

    @property
    def has_waiting(self) -> bool:
        """Whether any request has states waiting for a hand-over (held steps, prefill chunks)."""
        return bool(self._pending or self._held)

    def record(self, batch: StepBatch, states: torch.Tensor) -> StepHiddenStates:
        """The step's states (``[num_tokens, width]``, rows as ``batch`` lays out tokens).

        The positions are copied: a runner may build the next step's inputs into the same
        buffers while this step's states are still held."""
        step = StepHiddenStates(states, batch.positions.clone())
        sample_rows = batch.sample_rows
        drafts = batch.sample_drafts
        scheduled = np.asarray(batch.num_scheduled, dtype=np.int64)
        starts = np.zeros(len(scheduled), dtype=np.int64)
        np.cumsum(scheduled[:-1], out=starts[1:])
        rows = np.asarray(sample_rows, dtype=np.int64)
        step.req_ids = [batch.states[row].req_id for row in sample_rows]
        step.starts, step.counts = starts[rows], scheduled[rows]
        step.drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts)) if drafts is not None else np.zeros(len(rows), dtype=np.int64)
        if len(sample_rows) < len(batch.states):  # prefill chunks before the last: held (their rows only) for the request's next proposal
            sampling = set(sample_rows)
            for row, state in enumerate(batch.states):
                if row not in sampling:
                    first, count = int(starts[row]), batch.num_scheduled[row]
                    piece = slice(first, first + count)
                    self._pending.setdefault(state.req_id, []).append((states[piece].clone(), step.positions[piece].clone(), 0, count))
        return step

    def hold(self, step: StepHiddenStates, req_ids: list[str], num_accepted: list[int]) -> bool:
        """Hold the step's kept rows of ``req_ids`` (a step without drafts to follow) for their
        next ``gather``, so that one hand-over takes several steps' states: True if held;
        False once ``HOLD_STEPS - 1`` steps are held (gather this one with them now). The
        step's states are referenced, not copied."""
        if len(self._held) >= HOLD_STEPS - 1:
            return False
        starts, kept = step.kept(req_ids, num_accepted)
        self._held.append(_HeldStep(step, list(req_ids), starts, kept))
        return True

    def gather(self, step: StepHiddenStates, req_ids: list[str], num_accepted: list[int]) -> ProposerHiddenStates:
        """The states of ``req_ids`` not handed over yet: held rows first, then the step's
        kept rows (``num_accepted[i]``: 1 + the drafts kept of request ``i``), as one slice
        of the step's states where they are contiguous there, else one gather. Held rows of
        other requests stay for their own next hand-over."""
        held, self._held = self._held, []
        hand_over = _HandOver()
        if self._pending:  # pieces waiting per request come first: they are its oldest
            for i, req_id in enumerate(req_ids):
                for states, positions, first, rows in self._pending.pop(req_id, ()):
                    hand_over.add(states, positions, np.array([i]), np.array([first]), np.array([rows]))
        everyone = np.arange(len(req_ids), dtype=np.int64)
        where = None
        for entry in held:
            if entry.req_ids == req_ids:  # most often: the same requests, in the same order
                at = everyone
            else:
                where = where or {r: i for i, r in enumerate(req_ids)}
                at = np.fromiter((where.get(r, -1) for r in entry.req_ids), dtype=np.int64, count=len(entry.req_ids))
            mine = at >= 0
            if entry.gone:
                mine &= np.fromiter((r not in entry.gone for r in entry.req_ids), dtype=bool, count=len(entry.req_ids))
            if not mine.all():
                self._leave_behind(entry, np.flatnonzero(at < 0))
            if mine.any():
                hand_over.add(entry.step.states, entry.step.positions, at[mine], entry.starts[mine], entry.kept[mine])
        starts, kept = step.kept(req_ids, num_accepted)
        hand_over.add(step.states, step.positions, everyone, starts, kept)
        return hand_over.result(len(req_ids))

    def _leave_behind(self, entry: _HeldStep, others: np.ndarray) -> None:
        """A held step's rows of requests another hand-over did not take: kept per request for
        their own next one (those of dropped requests go nowhere)."""
        states, positions = entry.step.states, entry.step.positions
        for j in others.tolist():
            req_id = entry.req_ids[j]
            if req_id not in entry.gone and entry.kept[j]:
                self._pending.setdefault(req_id, []).append((states, positions, int(entry.starts[j]), int(entry.kept[j])))

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop what is held for finished or preempted requests."""
        for req_id in req_ids:
            self._pending.pop(req_id, None)
        for entry in self._held:
            entry.gone |= req_ids


class _HandOver:
    """The pieces of one hand-over: runs of rows of a few state tensors, each a request's (its
    index in the hand-over), added oldest first; joined into request order at the end."""

    def __init__(self) -> None:
        self._offset_of: dict[int, int] = {}  # id(states) -> its first row once the tensors are joined
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._total = 0
        self._owners: list[np.ndarray] = []  # per piece, its request
        self._firsts: list[np.ndarray] = []  # per piece, its first row among the joined tensors
        self._lengths: list[np.ndarray] = []  # per piece, its rows

    def add(self, states: torch.Tensor, positions: torch.Tensor, owners: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Pieces of ``states``/``positions``: request ``owners[j]``'s rows ``starts[j]`` to
        ``starts[j] + lengths[j]``."""
        offset = self._offset_of.get(id(states))
        if offset is None:
            offset = self._offset_of[id(states)] = self._total
            self._total += states.shape[0]
            self._parts.append((states, positions))
        self._owners.append(owners)
        self._firsts.append(offset + starts)
        self._lengths.append(lengths)

    def result(self, num_requests: int) -> ProposerHiddenStates:
        """Every request's rows together, in request order and each request's in the order
        added: a slice where they are one run, else one gather."""
        owner, first, length = (np.concatenate(parts) for parts in (self._owners, self._firsts, self._lengths))
        order = np.argsort(owner, kind="stable")
        owner, first, length = owner[order], first[order], length[order]
        counts = np.bincount(owner, weights=length, minlength=num_requests).astype(np.int64).tolist()
        if len(self._parts) == 1:
            states, positions = self._parts[0]
        else:
            states, positions = torch.cat([s for s, _ in self._parts]), torch.cat([p for _, p in self._parts])
        ends = np.cumsum(length)
        num_rows = int(ends[-1]) if len(ends) else 0
        if not num_rows:
            return ProposerHiddenStates(states[:0], positions[:0], counts)
        index = np.arange(num_rows, dtype=np.int64) + np.repeat(first - (ends - length), length)
        if bool((np.diff(index) == 1).all()):
            rows = slice(int(index[0]), int(index[0]) + num_rows)  # one run: a view
            return ProposerHiddenStates(states[rows], positions[rows], counts)
        on_device = to_device(index, states.device)
        return ProposerHiddenStates(states.index_select(0, on_device), positions.index_select(0, on_device), counts)
