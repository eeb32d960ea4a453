"""Paged KV-cache manager: block tables, a free list, reference counts and prefix caching.

Full blocks are identified by a hash chained over every token before them, so two requests
with the same prefix share the same physical blocks (a LoRA adapter's requests chain from their
adapter's own seed, so two adapters, or an adapter and the base model, never share one). Freed blocks keep their hash and stay
findable until the LRU free list hands them out again.

Sliding window: when every layer of the model slides (``SlidingWindowSpec``), the leading blocks
that lie wholly before the window of the request's next query are given back to the free list
as the request advances; they keep their place in the request's block list (so its length
still counts the request's positions, and the workers' append-only block tables stay aligned),
and their ids, now stale, are only ever read outside every query's window. When some layer
attends to the full context, every block is kept to the end: the sliding layers still mask
their window, with no saving in blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sonar.engine.kv_cache_spec import KVCacheSpec
from sonar.engine.request import Request


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # prompt tokens found cached


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class KVCacheManager:
    """Interface between the scheduler and the KV-cache blocks.

    Protocol: ``get_computed_blocks(req)`` once when a waiting request is first scheduled,
    ``allocate_slots(req, n, computed)`` before each step that computes ``n`` new tokens for
    it (False means: not enough free blocks, preempt something), ``free(req)`` when it finishes,
    is aborted or preempted.

    :param specs: the model's per-layer ``kv_cache_specs()``; None means full attention in
        every layer. Blocks slide out (are freed early) only when every layer slides.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, specs: list[KVCacheSpec] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)  # LRU: evict from the front
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.num_slid_out: dict[str, int] = {}  # leading blocks of a request given back early
        self.stats = PrefixCacheStats()
        self.layer_specs: tuple[KVCacheSpec, ...] = tuple(set(specs or ()))  # distinct kinds of layer
        self.gives_back_blocks = self.num_blocks_out_of_window(1 << 62) > 0  # every layer slides
        # hears of each prefix-cached block handed out to new contents: (block id, its hash)
        self.on_evict: Callable[[int, bytes], None] | None = None
        self._hashed_this_step: set[int] = set()  # with on_evict: blocks hashed but not computed yet

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them, reusable until handed out)."""
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its ``start``-th block on (those that slid out of its
        window included: stale ids, never read again by its attention)."""
        blocks = self.req_blocks.get(request_id)
        if not blocks or start >= len(blocks):
            return []
        return [b.block_id for b in blocks[start:]]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks that no layer reads again once a request has ``num_computed_tokens``
        tokens computed (0 unless every layer slides)."""
        if not self.layer_specs:
            return 0
        first_needed = min(spec.first_needed_position(num_computed_tokens) for spec in self.layer_specs)
        return first_needed // self.block_size

    def num_tokens_fitting(self, request_id: str) -> int:
        """Tokens the request's blocks and the free ones hold together: as many as it may
        reach without taking blocks from another request."""
        return (len(self.req_blocks.get(request_id, ())) + len(self.free_blocks)) * self.block_size

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (those slid out of its window not counted)."""
        return len(self.req_blocks.get(request_id, ())) - self.num_slid_out.get(request_id, 0)

    # -- prefix cache --------------------------------------------------------------------

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over its full blocks among the first num_tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            hashes.append(hash_block(hashes[-1] if hashes else request.block_hash_seed, request.tokens_range(start, start + bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks holding a prefix of the request, and how many tokens they cover."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # at least one token must be computed to produce logits
        max_hit_tokens = request.num_tokens - 1
        self._update_hashes(request, max_hit_tokens)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup whose request was admitted."""
        self.stats.num_queries += num_tokens
        self.stats.num_hits += num_hit_tokens

    def forget_free_blocks(self) -> None:
        """Drop the prefix-cache entries of every unreferenced block (after a failed step, whose
        blocks were hashed when scheduled but never written)."""
        for block in self.free_blocks.values():
            if block.block_hash is not None:
                if self.cached_blocks.get(block.block_hash) is block:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible (True) when no request holds a block."""
        if len(self.free_blocks) != self.num_blocks:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``
        (plus ``computed_blocks`` from the prefix cache for a newly scheduled request)."""
        if not computed_blocks and not self.gives_back_blocks:  # a running request's next tokens
            held = self.req_blocks.get(request.request_id)
            if held is not None:
                total_tokens = request.num_computed_tokens + num_new_tokens
                num_needed = -(-total_tokens // self.block_size) - len(held)
                if num_needed > len(self.free_blocks):
                    return False
                for _ in range(num_needed):
                    held.append(self._pop_free_block())
                if self.enable_prefix_caching:
                    self._cache_full_blocks(request, held, total_tokens)
                return True
        computed_blocks = computed_blocks or []
        self._slide_out(request.request_id, request.num_computed_tokens)
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = self.num_blocks_for(total_tokens) - len(held) - len(computed_blocks)
        # cached blocks taken from the free list also count against it, unless they slide out at once
        num_kept = len(computed_blocks) - min(self.num_blocks_out_of_window(num_computed), len(computed_blocks))
        num_reused_free = sum(1 for b in computed_blocks[len(computed_blocks) - num_kept :] if b.ref_cnt == 0)
        if num_needed + num_reused_free > len(self.free_blocks):
            return False
        for block in computed_blocks:
            if block.ref_cnt == 0:
                del self.free_blocks[block.block_id]
            block.ref_cnt += 1
        blocks = self.req_blocks.setdefault(request.request_id, held)
        blocks.extend(computed_blocks)
        self._slide_out(request.request_id, num_computed)
        for _ in range(max(num_needed, 0)):
            blocks.append(self._pop_free_block())
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        return True

    def _pop_free_block(self) -> KVBlock:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                if self.on_evict is not None and block.block_id not in self._hashed_this_step:
                    self.on_evict(block.block_id, block.block_hash)
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        first = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        self._update_hashes(request, num_full * self.block_size)
        self.num_hashed_blocks[request.request_id] = num_full
        # a block that slid out may hold another request's tokens by now: never hashed as ours
        for index in range(max(first, self.num_slid_out.get(request.request_id, 0)), num_full):
            block = blocks[index]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[index]
            block.block_hash = block_hash
            self.cached_blocks.setdefault(block_hash, block)
            if self.on_evict is not None:
                self._hashed_this_step.add(block.block_id)

    def _slide_out(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the request's leading blocks that no layer reads again; they keep their
        hash (findable by a prefix lookup until handed out) and their slot in its list."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        first = self.num_slid_out.get(request_id, 0)
        last = min(self.num_blocks_out_of_window(num_computed_tokens), len(blocks))
        if last <= first:
            return
        for block in blocks[first:last]:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block.block_id] = block
        self.num_slid_out[request_id] = last

    def begin_step(self) -> None:
        """A new step is being scheduled: the blocks hashed so far hold computed contents (or
        will have, by the time anything reads them) once this step runs."""
        self._hashed_this_step.clear()

    def uncache_blocks(self, request: Request, num_kept_blocks: int) -> None:
        """Take the request's blocks from its ``num_kept_blocks``-th on out of the prefix cache
        (a connector fills them asynchronously: nobody may find them before); they are hashed
        again as the request is scheduled."""
        for block in self.req_blocks.get(request.request_id, [])[num_kept_blocks:]:
            if block.block_hash is not None and block.ref_cnt == 1:
                if self.cached_blocks.get(block.block_hash) is block:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
        hashed = self.num_hashed_blocks.get(request.request_id, 0)
        self.num_hashed_blocks[request.request_id] = min(hashed, num_kept_blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks; the newest are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        num_slid_out = self.num_slid_out.pop(request.request_id, 0)
        for block in reversed(blocks[num_slid_out:]):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block.block_id] = block
