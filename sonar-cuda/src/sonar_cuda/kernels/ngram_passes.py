"""The work between two n-gram verify passes queued on the device, in one launch.

``PassChain.advance`` as device operations is some seventy small launches a pass (keeping the
confirmed drafts, extending the sequence, the lookup, laying the next pass out); here one
program does all of it: it reads the pass's target tokens and inputs, emits the kept tokens
into the step's output and the request's sequence, scores every earlier position of the
sequence against its new ending (the longest recurring suffix of ``prompt_lookup_min`` to
``prompt_lookup_max`` tokens, its latest occurrence), and writes the next pass's token ids,
positions, slots and attention lengths into the decode graph's buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sonar.spec_decode.device_passes import PassChain, PassRows
from sonar.spec_decode.interface import Proposer
from sonar.spec_decode.ngram import NgramProposer
from sonar_cuda.kernels.pass_settle import settle_pass

SCAN_BLOCK = 1024  # earlier positions scored at once (a score: tokens matched * 2**40 + position)


@triton.jit(do_not_specialize=["rows", "pass_index", "num_stops"])  # one compile for every pass of every step
def _ngram_advance_kernel(
    greedy_ptr, inputs_ptr, rows,
    state_ptr, seq_ptr, emitted_ptr, stats_ptr, pass_index, stop_ptr, num_stops,
    table_ptr, block_size, max_blocks,
    out_tokens_ptr, out_positions_ptr, out_slots_ptr, out_lens_ptr,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, BLOCK_R)
    # the pass just run: keep its drafts up to the first the target disagrees with
    length, position, emitted, live, end, _, _ = settle_pass(
        greedy_ptr, inputs_ptr, rows, state_ptr, seq_ptr, emitted_ptr, stats_ptr, pass_index, stop_ptr, num_stops, BLOCK_R
    )
    tl.debug_barrier()  # the sequence's new tokens, and the pass's inputs read, before the lookup and the writes

    # the lookup: every earlier position scored by the tokens matched backwards from it
    best = tl.full([], -1, tl.int64)
    for first in range(0, length - 1, BLOCK_L):
        ends = first + tl.arange(0, BLOCK_L).to(tl.int64)
        usable = ends <= length - 2
        run = usable
        matched = tl.zeros([BLOCK_L], tl.int64)
        for back in tl.static_range(MAX_N):
            suffix = tl.load(seq_ptr + tl.maximum(length - 1 - back, 0))
            earlier = tl.load(seq_ptr + ends - back, mask=usable & (ends >= back), other=-1)
            run = run & (earlier == suffix) & (ends >= back) & (length - 1 - back >= 0)
            matched += run.to(tl.int64)
        score = tl.where(usable & (matched >= MIN_N), matched * 1099511627776 + ends, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    start = best % 1099511627776 + 1
    found = tl.where(best >= 0, tl.minimum(tl.maximum(length - start, 0), K), 0)
    room = tl.maximum(end - position - 1, 0)
    drafts = tl.minimum(found, room) * live

    # the next pass's rows: the last token emitted, then the drafts
    known = tl.load(seq_ptr + length - 1)
    draft = tl.load(seq_ptr + start + r - 1, mask=(r >= 1) & (r <= drafts), other=0)
    token = tl.where(r == 0, known, draft)
    positions = position + r
    writes = (positions < end) & (live > 0)
    block = tl.load(table_ptr + tl.minimum(positions // block_size, max_blocks - 1), mask=r <= K, other=0).to(tl.int64)
    slots = tl.where(writes, block * block_size + positions % block_size, -1)
    lens = tl.maximum(tl.minimum(positions + 1, end), 1)
    row = r <= K
    tl.store(out_tokens_ptr + r, token, mask=row)
    tl.store(out_positions_ptr + r, positions, mask=row)
    tl.store(out_slots_ptr + r, slots, mask=row)
    tl.store(out_lens_ptr + r, lens.to(tl.int32), mask=row)
    tl.store(state_ptr + 0, length)
    tl.store(state_ptr + 1, position)
    tl.store(state_ptr + 2, emitted)
    tl.store(state_ptr + 3, live)
    tl.store(state_ptr + 6, drafts)


class NgramPassChain(PassChain):
    """A ``PassChain`` whose work between passes is one launch (n-gram proposers only)."""

    def advance(self, greedy: torch.Tensor, inputs: torch.Tensor, rows: PassRows, proposer: Proposer) -> None:
        if not isinstance(proposer, NgramProposer):  # another proposer's lookup: as separate operations
            super().advance(greedy, inputs, rows, proposer)
            return
        k = self.k
        _ngram_advance_kernel[(1,)](
            greedy, inputs, greedy.shape[0],
            self.state, self.sequence, self.emitted, self.stats, self.passes, self.stop_ids, self.stop_ids.numel(),
            self.block_row, self.block_size, self.block_row.shape[0],
            rows.token_ids, rows.positions, rows.slots, rows.seq_lens,
            MIN_N=proposer.min_n, MAX_N=proposer.max_n, K=k, BLOCK_R=triton.next_power_of_2(k + 1), BLOCK_L=SCAN_BLOCK,
        )  # fmt: skip
        self.passes += 1
