"""Settling a verify pass queued on the device, inside a kernel that lays out the next one
(``PassChain.settle`` in one program's registers): shared by the n-gram and drafter chains."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def settle_pass(greedy_ptr, inputs_ptr, rows, state_ptr, seq_ptr, emitted_ptr, stats_ptr, pass_index, stop_ptr, num_stops, BLOCK_R: tl.constexpr):
    """Keep the pass's drafts up to the first the target disagrees with, emit them and the
    target's token after them into the step's output and the request's sequence, record the
    pass's counts, and stop further passes at a stop token, ``max_tokens`` or the step's last
    row. Returns the chain's new length, position, emitted count and live flag, its end, the
    rows the pass kept (0: it did not run) and the last token emitted. The state is not
    written back: the caller stores what it changes."""
    r = tl.arange(0, BLOCK_R)
    length = tl.load(state_ptr + 0)
    position = tl.load(state_ptr + 1)
    emitted = tl.load(state_ptr + 2)
    live = tl.load(state_ptr + 3)
    end = tl.load(state_ptr + 4)
    limit = tl.load(state_ptr + 5)
    num_drafts = tl.load(state_ptr + 6)
    last = tl.load(seq_ptr + length - 1)

    greedy = tl.load(greedy_ptr + r, mask=r < rows, other=-1)
    following = tl.load(inputs_ptr + r + 1, mask=r + 1 < rows, other=-2)
    agree = (following == greedy) & (r < num_drafts) & (r + 1 < rows)
    kept = tl.min(tl.where(agree, BLOCK_R, r), axis=0).to(tl.int64) * live
    emits = (r <= kept) & (live > 0) & (r < rows)
    tl.store(emitted_ptr + emitted + r, greedy, mask=emits)
    tl.store(seq_ptr + length + r, greedy, mask=emits)
    tl.store(stats_ptr + pass_index * 3 + 0, num_drafts * live)
    tl.store(stats_ptr + pass_index * 3 + 1, kept)
    tl.store(stats_ptr + pass_index * 3 + 2, live)
    stopped = tl.zeros([], tl.int32)
    for s in range(num_stops):
        stop = tl.load(stop_ptr + s)
        stopped += tl.sum(((greedy == stop) & emits).to(tl.int32), axis=0)
    step = (kept + 1) * live
    anchor = tl.where(step > 0, tl.sum(tl.where(r == kept, greedy, 0), axis=0).to(tl.int64), last)
    emitted += step
    position += step
    length += step
    live = live * (stopped == 0).to(tl.int64) * (emitted < limit).to(tl.int64) * (position < end).to(tl.int64)
    return length, position, emitted, live, end, step, anchor
