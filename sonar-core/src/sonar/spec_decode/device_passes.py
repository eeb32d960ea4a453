"""Several verify passes of one request queued on the device at once (``verify_passes`` with a
proposer that ``drafts_on_device``).

Between two passes the device itself keeps the drafts the target confirmed, extends the
request's sequence with the tokens emitted, drafts from its new ending and lays out the next
pass's inputs, so the host launches every pass of a step without reading one back: the
passes run back to back, and the host's own work for each overlaps the passes before it.

Every pass after the first has ``k + 1`` rows: the known token and ``k`` draft slots (slots
past the drafts found hold zeros and are never kept). A pass that can no longer run (the
step's rows used up, a stop token or ``max_tokens`` reached in a pass before) writes nothing
to the KV cache and emits nothing. The host reads the emitted tokens and each pass's counts
with the step's results (``DevicePasses.read``): the same tokens, passes and counts as the
host's loop of passes (``ModelRunner._further_passes``) gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.spec_decode.interface import Proposer
from sonar.tensors import to_device


@dataclass(slots=True)
class DevicePasses:
    """A step's passes as the host reads them back (copies queued before the step's event)."""

    start: int  # the request's computed tokens before the step
    tokens: torch.Tensor  # int64 [capacity]: the tokens emitted, in order
    count: torch.Tensor  # int64 [1]: how many
    stats: torch.Tensor  # int64 [passes, 3]: per pass its drafts, the drafts kept, whether it ran

    def read(self) -> tuple[list[int], list[list[int]]]:
        """The tokens emitted and ``[drafts, kept]`` of every pass that ran."""
        count = int(self.count[0])
        return self.tokens[:count].tolist(), [[drafts, kept] for drafts, kept, ran in self.stats.tolist() if ran]


@dataclass(slots=True)
class PassRows:
    """Where a pass's ``k + 1`` rows go: token ids, positions and KV-cache slots (-1: not
    written), int64, and attention lengths (int32): the decode graph's input buffers."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor


class PassChain:
    """The device state of a step's passes: the request's sequence, where the next pass
    starts, what was emitted, and whether passes may still run. Built once per runner; every
    tensor is reused from step to step."""

    def __init__(self, capacity: int, k: int, max_passes: int, device: torch.device) -> None:
        """``capacity``: the longest sequence (``max_model_len``); ``k``: draft slots a pass;
        ``max_passes``: passes a step at most (``verify_passes``)."""
        self.k, self.capacity, self.device = k, capacity, device
        self.sequence = torch.zeros(capacity + 1, dtype=torch.int64, device=device)  # the last entry: writes masked off
        self.emitted = torch.zeros(max_passes * (k + 1) + 1, dtype=torch.int64, device=device)  # likewise
        self.stats = torch.zeros(max_passes, 3, dtype=torch.int64, device=device)
        self.offsets = torch.arange(k + 1, device=device)  # a pass's rows
        # length, next position, emitted, passes may run, end, outputs still allowed, drafts of the pass laid out
        self.state = torch.zeros(7, dtype=torch.int64, device=device)
        self.stop_ids = torch.zeros(0, dtype=torch.int64, device=device)
        self.block_row: torch.Tensor | None = None
        self.block_size = 0
        self.passes = 0
        self.start = 0
        self.kept_rows = torch.zeros((), dtype=torch.int64, device=device)  # the last pass settled: its rows kept (0: it did not run)

    def begin(
        self,
        token_ids: list[int],
        end: int,
        num_outputs: int,
        max_tokens: int | None,
        stop_ids: set[int],
        block_row: torch.Tensor,
        block_size: int,
        num_drafts: int,
    ) -> None:
        """A step of one request whose first pass is queued: ``token_ids`` its sequence up to
        the pass's known token (the first row), ``end`` the position past the rows the step
        may use, ``num_outputs`` its outputs before the step, ``block_row`` its row of the
        device block table, ``num_drafts`` the first pass's drafts."""
        length = len(token_ids)
        self.start = length - 1
        self.passes = 0
        self.sequence[:length].copy_(to_device(torch.tensor(token_ids, dtype=torch.int64), self.device))
        limit = max_tokens - num_outputs if max_tokens is not None else self.emitted.shape[0]
        values = torch.tensor([length, self.start, 0, 1, end, limit, num_drafts], dtype=torch.int64)
        self.state.copy_(to_device(values, self.device))
        self.stop_ids = to_device(torch.tensor(sorted(stop_ids), dtype=torch.int64), self.device)
        self.block_row, self.block_size = block_row, block_size

    def advance(self, greedy: torch.Tensor, inputs: torch.Tensor, rows: PassRows, proposer: Proposer) -> None:
        """``settle`` the pass just run, then lay the next one out into ``rows`` (which may
        be the buffers ``inputs`` is a view of: they are read first) with the drafts
        ``proposer`` finds for the sequence's new ending (``propose_on_device``)."""
        self.settle(greedy, inputs)
        drafts, found = proposer.propose_on_device(self.sequence, self.state[0], self.k)
        self.lay_out(rows, drafts, found)

    def settle(self, greedy: torch.Tensor, inputs: torch.Tensor) -> None:
        """Take a queued pass's results: ``greedy`` its target tokens (one per row, at most
        ``k + 1``), ``inputs`` the ids it ran on (the known token, then its drafts). Keeps
        the drafts up to the first the target disagrees with, emits them and the target's
        token after them, and stops further passes at a stop token, ``max_tokens`` or the end
        of the step's rows."""
        length, position, emitted, live, end, limit, num_drafts = self.state.unbind()
        rows = greedy.shape[0]
        offsets = self.offsets[:rows]
        agree = (inputs[1:rows] == greedy[: rows - 1]) & (offsets[: rows - 1] < num_drafts)
        kept = agree.long().cumprod(0).sum() * live
        emits = (offsets <= kept) & (live > 0)
        self.emitted.scatter_(0, torch.where(emits, emitted + offsets, self.emitted.shape[0] - 1), greedy)
        self.sequence.scatter_(0, torch.where(emits, (length + offsets).clamp(max=self.capacity), self.capacity), greedy)
        self.stats[self.passes] = torch.stack([live * num_drafts, kept, live])
        self.passes += 1
        step = (kept + 1) * live
        self.kept_rows = step
        stopped = (torch.isin(greedy, self.stop_ids) & emits).any()
        emitted = emitted + step
        position = position + step
        live = live * (~stopped).long() * (emitted < limit).long() * (position < end).long()
        self.state.copy_(torch.stack([length + step, position, emitted, live, end, limit, num_drafts]))

    def anchor(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last token emitted and its position (0-d, on the device): the next pass's known
        token, which the passes before have not computed (a block drafter drafts after it)."""
        length, position = self.state[0], self.state[1]
        return self.sequence.gather(0, (length - 1).view(1))[0], position.clone()

    def lay_out(self, rows: PassRows, drafts: torch.Tensor, found: torch.Tensor | int) -> None:
        """Write the next pass's rows: the last token emitted, then the first ``found`` of
        ``drafts`` (int64 ``[k]`` on the device; ``found`` 0-d or an int), as many as the
        step's rows leave room for."""
        length, position, _, live, end, _, _ = self.state.unbind()
        room = (end - position - 1).clamp(min=0)
        num_drafts = (room.clamp(max=found) if isinstance(found, int) else torch.minimum(found, room)) * live
        offsets = self.offsets
        token_ids = torch.cat([self.sequence.gather(0, (length - 1).view(1)), torch.where(offsets[1:] <= num_drafts, drafts, 0)])
        positions = position + offsets
        writes = (positions < end) & (live > 0)
        blocks = self.block_row.gather(0, (positions // self.block_size).clamp(max=self.block_row.shape[0] - 1)).long()
        slots = torch.where(writes, blocks * self.block_size + positions % self.block_size, -1)
        rows.token_ids.copy_(token_ids)
        rows.positions.copy_(positions)
        rows.slots.copy_(slots)
        rows.seq_lens.copy_(torch.minimum(positions + 1, end).clamp(min=1))
        self.state[6] = num_drafts

    def finish(self) -> DevicePasses:
        """Queue the copies of what the host reads back (before the step's event)."""
        return DevicePasses(start=self.start, tokens=_host_copy(self.emitted), count=_host_copy(self.state[2:3]), stats=_host_copy(self.stats[: self.passes]))


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued (on the CPU a copy too: the chain's tensors are reused)."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu", non_blocking=True)
