"""A drafter pass over a padded batch: static inputs, one graph per (batch size, slots read).

The core decides the shapes: a pass of ``n`` requests that reads up to ``s`` slots of each
request's drafter cache runs at the smallest captured batch size ``>= n`` and the smallest
slot bucket ``>= s`` (powers of two in blocks); rows past ``n`` are padding (the cache's
padding row: it reads and writes the scratch block only). The platform captures: where it
gives a :class:`GraphCapturer` (CUDA) every (size, bucket) is captured once at start-up and
replayed; elsewhere, and for a pass too large for every graph, the pass runs eagerly at its
own shape (``n`` rows, exactly the slots it needs), as the drafters always ran.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from sonar.spec_decode.hidden_states import HOLD_STEPS

logger = logging.getLogger(__name__)

#: Batch sizes a drafter pass is captured at (up to ``max_num_seqs``): the drafter's share of
#: a step is largest at small batches, where its eager launches dominate; the large sizes read
#: fewer slots (``DRAFT_GRAPH_MAX_GATHER``: 256 requests up to 512 each).
DRAFT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Row counts a pass over the target's new states (a drafter's context upkeep) is captured at:
#: a step's kept positions (up to ``k + 1`` per request) or ``HOLD_STEPS`` held steps' together
#: (4,096 rows: 256 requests; an eager pass of that size costs the host milliseconds of launches).
CONTEXT_GRAPH_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: The most slots per request a captured pass reads (longer contexts run eagerly): a pass
#: gathers ``size x slots`` keys and values per layer.
DRAFT_GRAPH_MAX_SLOTS = 8192
#: The largest gather a captured pass makes (``size x slots``): 16 requests at the most slots,
#: 64 requests at a quarter of them, 256 at a sixteenth; a pass past it runs eagerly.
DRAFT_GRAPH_MAX_GATHER = 16 * DRAFT_GRAPH_MAX_SLOTS

Inputs = dict[str, torch.Tensor]
PassFn = Callable[[Inputs, int], tuple[torch.Tensor, ...]]


class GraphCapturer(Protocol):
    """What a platform that captures graphs lends a drafter (``Platform.draft_graph_capturer``)."""

    def capture(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Warm ``run`` up, capture it, and return a replay that refills and returns the
        tensors the capture returned."""
        ...

    def synchronize(self) -> None: ...


def slot_buckets(block_size: int, max_slots: int, limit: int = DRAFT_GRAPH_MAX_SLOTS) -> list[int]:
    """Slot counts a pass is captured at: 1, 2, 4, ... blocks, up to ``max_slots`` (rounded up
    to a block) or ``limit``, whichever is smaller."""
    top = min(-(-max_slots // block_size) * block_size, max(limit, block_size))
    buckets, blocks = [], 1
    while blocks * block_size < top:
        buckets.append(blocks * block_size)
        blocks *= 2
    buckets.append(top)
    return buckets


class DraftPass:
    """One drafter pass (``fn(inputs, num_slots)``: ``inputs`` per name ``[rows, ...]``, the
    first read covering ``num_slots`` slots and each later one ``extra_slots`` more at most),
    eager or replayed. A pass that reads no slots is captured with the one bucket ``0``.

    :param inputs: static buffers ``[max_size, ...]`` per input name, on the device.
    :param padding: the value the padding rows of these inputs hold (the inputs that say where
        a pass reads or writes: the cache's padding row, the scratch slot); the padding rows of
        the others keep what they last held (any value computes something that is dropped).
    """

    def __init__(self, name: str, fn: PassFn, inputs: Inputs, padding: dict[str, int | float], extra_slots: int = 0) -> None:
        self.name = name
        self.fn = fn
        self.inputs = inputs
        self.padding = padding
        self.extra_slots = extra_slots
        self.sizes: list[int] = []
        self.buckets: list[int] = []
        self.replays: dict[tuple[int, int], Callable[[], tuple[torch.Tensor, ...]]] = {}

    @property
    def captured(self) -> bool:
        return bool(self.replays)

    def shape_for(self, num_rows: int, num_slots: int) -> tuple[int, int] | None:
        """The captured (batch size, slot bucket) of a pass of ``num_rows`` rows reading up to
        ``num_slots`` slots in all, or None where no graph holds it."""
        size = next((s for s in self.sizes if s >= num_rows), None)
        bucket = next((b for b in self.buckets if b >= num_slots), None)
        if size is None or bucket is None or (size, bucket) not in self.replays:
            return None
        return size, bucket

    @torch.inference_mode()
    def capture(self, capturer: GraphCapturer, sizes: list[int], buckets: list[int]) -> None:
        """Capture every (size, bucket) whose gather is within ``DRAFT_GRAPH_MAX_GATHER``,
        largest first, with padding in every row."""
        started = time.perf_counter()
        for name, value in self.padding.items():
            self.inputs[name].fill_(value)
        try:
            for size in sorted(sizes, reverse=True):
                for bucket in sorted(buckets, reverse=True):
                    if not self._usable(bucket) or size * bucket > DRAFT_GRAPH_MAX_GATHER:
                        continue
                    views = {name: buffer[:size] for name, buffer in self.inputs.items()}
                    self.replays[(size, bucket)] = capturer.capture(lambda views=views, bucket=bucket: self.fn(views, bucket - self.extra_slots))
            capturer.synchronize()
        except RuntimeError as exc:  # a pass a platform cannot capture runs eagerly: the engine still starts
            self.replays.clear()
            logger.error("the %s pass could not be captured in a graph (%s); it runs eagerly", self.name, exc)
            return
        self.sizes, self.buckets = sorted(sizes), sorted(b for b in buckets if self._usable(b))
        logger.info("captured %d %s graphs (batch sizes %s, slots %s) in %.1f s", len(self.replays), self.name, self.sizes, self.buckets, time.perf_counter() - started)

    def _usable(self, bucket: int) -> bool:
        """Whether a graph at ``bucket`` slots holds a pass (its later reads need
        ``extra_slots`` more than the first's)."""
        return bucket > self.extra_slots or bucket == self.extra_slots == 0

    def run(self, values: Inputs, num_slots: int = 0) -> tuple[torch.Tensor, ...]:
        """The pass over ``values`` (``[n, ...]`` per input) reading ``num_slots`` slots first
        (the longest request's): replayed where a graph holds it, eager otherwise; outputs
        ``[n, ...]``."""
        num_rows = next(iter(values.values())).shape[0]
        shape = self.shape_for(num_rows, num_slots + self.extra_slots)
        if shape is None:
            return self.fn(values, num_slots)
        size, bucket = shape
        for name, value in values.items():
            buffer = self.inputs[name]
            buffer[:num_rows].copy_(value, non_blocking=True)
            if size > num_rows and name in self.padding:
                buffer[num_rows:size].fill_(self.padding[name])
        return tuple(out[:num_rows] for out in self.replays[(size, bucket)]())


def capture_sizes(max_num_seqs: int, max_batch_size: int) -> list[int]:
    """``DRAFT_GRAPH_SIZES`` up to the most requests one pass drafts for (the engine's
    ``max_num_seqs``, speculation's ``disable_by_batch_size``), that limit itself included
    where it is below the largest."""
    limit = min(max_num_seqs, max_batch_size, DRAFT_GRAPH_SIZES[-1])
    return sorted({s for s in DRAFT_GRAPH_SIZES if s <= limit} | {limit})


def context_sizes(max_num_seqs: int, rows_per_request: int) -> list[int]:
    """``CONTEXT_GRAPH_ROWS`` up to the first that holds ``rows_per_request`` rows of each of
    ``max_num_seqs`` requests (larger hand-overs, such as whole prompts, run eagerly)."""
    most = max_num_seqs * rows_per_request
    sizes = [rows for rows in CONTEXT_GRAPH_ROWS if rows < most]
    return sizes + [rows for rows in CONTEXT_GRAPH_ROWS if rows >= most][:1]


def build_context_pass(
    name: str, fn: PassFn, max_num_seqs: int, num_speculative_tokens: int, state_width: int, dtype: torch.dtype, device: torch.device,
    token_inputs: tuple[str, ...] = (),
) -> tuple[DraftPass, list[int]]:
    """A drafter's context pass and the row counts to capture it at. ``fn`` reads ``states``
    ``[rows, state_width]``, their ``positions``, the cache ``slots`` it writes and each name
    of ``token_inputs`` (int64 per row); padding rows write the scratch block's first slot.
    The counts hold a step's kept positions (``k + 1`` a request) or ``HOLD_STEPS`` held
    steps of ``max_num_seqs`` requests."""
    sizes = context_sizes(max_num_seqs, max(HOLD_STEPS, num_speculative_tokens + 1))
    rows = max(sizes)
    inputs = {"states": torch.zeros((rows, state_width), dtype=dtype, device=device)}
    for input_name in (*token_inputs, "positions", "slots"):
        inputs[input_name] = torch.zeros((rows,), dtype=torch.int64, device=device)
    return DraftPass(name, fn, inputs, {"slots": 0}), sizes


class ReplayCapturer:
    """A capturer for platforms without graphs: "capturing" runs the pass once, and every
    replay runs it again at the captured shape over the same static inputs. It takes a
    drafter through the padded shapes and buffers a graph would replay (padding rows, slot
    buckets) where no graph can be captured, to check them against the eager pass."""

    def __init__(self) -> None:
        self.num_captured = 0

    def capture(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
        run()
        self.num_captured += 1
        return run

    def synchronize(self) -> None:
        """Nothing is queued: the passes ran on the host."""
