"""The work between two verify passes of a drafter queued on the device, in two launches.

``PassChain.settle`` and ``PassChain.lay_out`` as device operations are some sixty small
launches a pass; here one program settles the pass just run (keeps its drafts up to the first
the target disagrees with, emits them and the token after them into the step's output and the
request's sequence, stops the passes at a stop token, ``max_tokens`` or the step's last row,
and writes what the drafter reads: the rows kept, the last token emitted and its position),
and after the drafter has drafted, one program lays the next pass out from its drafts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.spec_decode.device_passes import PassChain, PassRows
from sonar_cuda.kernels.pass_settle import settle_pass


@triton.jit(do_not_specialize=["rows", "pass_index", "num_stops"])  # one compile for every pass of every step
def _settle_kernel(
    greedy_ptr, inputs_ptr, rows,
    state_ptr, seq_ptr, emitted_ptr, stats_ptr, pass_index, stop_ptr, num_stops, anchor_ptr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    length, position, emitted, live, _, step, anchor = settle_pass(
        greedy_ptr, inputs_ptr, rows, state_ptr, seq_ptr, emitted_ptr, stats_ptr, pass_index, stop_ptr, num_stops, BLOCK_R
    )
    tl.debug_barrier()  # every thread has read the state before it is written
    tl.store(state_ptr + 0, length)
    tl.store(state_ptr + 1, position)
    tl.store(state_ptr + 2, emitted)
    tl.store(state_ptr + 3, live)
    tl.store(anchor_ptr + 0, step)
    tl.store(anchor_ptr + 1, anchor)
    tl.store(anchor_ptr + 2, position)


@triton.jit
def _lay_out_kernel(
    state_ptr, seq_ptr, drafts_ptr, table_ptr, block_size, max_blocks,
    out_tokens_ptr, out_positions_ptr, out_slots_ptr, out_lens_ptr,
    K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, BLOCK_R)
    length = tl.load(state_ptr + 0)
    position = tl.load(state_ptr + 1)
    live = tl.load(state_ptr + 3)
    end = tl.load(state_ptr + 4)
    drafts = tl.minimum(tl.maximum(end - position - 1, 0), K) * live
    known = tl.load(seq_ptr + length - 1)
    draft = tl.load(drafts_ptr + r - 1, mask=(r >= 1) & (r <= drafts), other=0)
    token = tl.where(r == 0, known, draft)
    positions = position + r
    writes = (positions < end) & (live > 0)
    row = r <= K
    block = tl.load(table_ptr + tl.minimum(positions // block_size, max_blocks - 1), mask=row, other=0).to(tl.int64)
    slots = tl.where(writes, block * block_size + positions % block_size, -1)
    lens = tl.maximum(tl.minimum(positions + 1, end), 1)
    tl.store(out_tokens_ptr + r, token, mask=row)
    tl.store(out_positions_ptr + r, positions, mask=row)
    tl.store(out_slots_ptr + r, slots, mask=row)
    tl.store(out_lens_ptr + r, lens.to(tl.int32), mask=row)
    tl.store(state_ptr + 6, drafts)


class DrafterPassChain(PassChain):
    """A ``PassChain`` whose settling and lay-out are one launch each (a drafter's drafts
    between passes: ``k`` of them, from the device)."""

    def __init__(self, capacity: int, k: int, max_passes: int, device: torch.device) -> None:
        super().__init__(capacity, k, max_passes, device)
        self._anchor = torch.zeros(3, dtype=torch.int64, device=device)  # rows kept, last token emitted, its position
        self._block_r = triton.next_power_of_2(k + 1)

    def settle(self, greedy: torch.Tensor, inputs: torch.Tensor) -> None:
        _settle_kernel[(1,)](
            greedy, inputs, greedy.shape[0],
            self.state, self.sequence, self.emitted, self.stats, self.passes, self.stop_ids, self.stop_ids.numel(), self._anchor,
            BLOCK_R=self._block_r, num_warps=1,
        )  # fmt: skip
        self.passes += 1
        self.kept_rows = self._anchor[0]

    def anchor(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._anchor[1], self._anchor[2]

    def lay_out(self, rows: PassRows, drafts: torch.Tensor, found: torch.Tensor | int) -> None:
        if not isinstance(found, int) or found != self.k:  # fewer drafts than a block: as separate operations
            super().lay_out(rows, drafts, found)
            return
        _lay_out_kernel[(1,)](
            self.state, self.sequence, drafts, self.block_row, self.block_size, self.block_row.shape[0],
            rows.token_ids, rows.positions, rows.slots, rows.seq_lens,
            K=self.k, BLOCK_R=self._block_r, num_warps=1,
        )  # fmt: skip
