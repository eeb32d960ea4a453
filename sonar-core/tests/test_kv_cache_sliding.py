"""Per-layer KV-cache specs: blocks that slide out of every layer's window are given back early,
exactly, without breaking reference counts, prefix caching, preemption or the scheduler."""

from __future__ import annotations

import pytest

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from sonar.engine.request import Request
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.sampling_params import SamplingParams

WINDOW = 16
BLOCK = 4
SLIDING = [SlidingWindowSpec(WINDOW)] * 3


def _request(request_id: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), [0], max_tokens)


def _decode(kv: KVCacheManager, request: Request, token: int = 5) -> None:
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    request.output_token_ids.append(token)


def _check_references(kv: KVCacheManager) -> None:
    """Every block's ref count is the number of requests holding it (slid-out slots not
    counted), and the free list holds exactly the unreferenced blocks."""
    holders = [0] * kv.num_blocks
    for request_id, blocks in kv.req_blocks.items():
        for block in blocks[kv.num_slid_out.get(request_id, 0) :]:
            holders[block.block_id] += 1
    assert [b.ref_cnt for b in kv.blocks] == holders
    assert set(kv.free_blocks) == {i for i, n in enumerate(holders) if n == 0}


def test_spec_window_arithmetic() -> None:
    spec = SlidingWindowSpec(16)
    # the query at 40 reads 25..40: positions 0..24 are never read again
    assert spec.first_needed_position(40) == 25
    assert spec.first_needed_position(15) == 0 and spec.first_needed_position(16) == 1
    assert FullAttentionSpec().first_needed_position(10**6) == 0
    with pytest.raises(ValueError, match="at least 1"):
        SlidingWindowSpec(0)


def test_blocks_before_the_window_are_freed_as_decoding_advances() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, specs=SLIDING)
    request = _request("a", list(range(100, 140)))  # 40 prompt tokens
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    # the prefill's own queries read from position 0: all 10 blocks held
    assert kv.num_held_blocks("a") == 10 and kv.num_free_blocks == 22
    # before computing position L the request needs L-15..L: blocks (L-15)//4 .. L//4
    expected_held = {40: 5, 41: 5, 42: 5, 43: 4, 44: 5, 45: 5, 46: 5, 47: 4, 48: 5}
    for num_computed, held in expected_held.items():
        assert request.num_computed_tokens == num_computed
        _decode(kv, request)
        assert kv.num_held_blocks("a") == held, f"at {num_computed} computed"
        assert kv.num_free_blocks == 32 - held
        # the block list still spans every position: the scheduler's arithmetic holds
        assert len(kv.block_ids("a")) == kv.num_blocks_for(num_computed + 1)
        _check_references(kv)
    kv.free(request)
    assert kv.num_free_blocks == 32
    _check_references(kv)


def test_chunked_prefill_frees_behind_the_window_between_chunks() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, specs=SLIDING)
    request = _request("a", list(range(100, 140)))
    held_after_chunk = []
    for _ in range(5):  # 5 chunks of 8
        assert kv.allocate_slots(request, 8)
        request.num_computed_tokens += 8
        held_after_chunk.append(kv.num_held_blocks("a"))
    # the chunk starting at L needs its own ceil((L + 8) / 4) blocks less the (L - 15) // 4 before
    # its first window: L = 0, 8, 16 free none; L = 24 frees 2, L = 32 frees 4
    assert held_after_chunk == [2, 4, 6, 8 - 2, 10 - 4]
    _check_references(kv)
    kv.free(request)
    assert kv.num_free_blocks == 32


def test_a_full_attention_layer_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, specs=[FullAttentionSpec(), SlidingWindowSpec(WINDOW)])
    request = _request("a", list(range(100, 140)))
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    for _ in range(9):
        _decode(kv, request)
    assert kv.num_held_blocks("a") == kv.num_blocks_for(49) == 13
    kv.free(request)
    assert kv.num_free_blocks == 32


def test_windows_of_different_sizes_free_for_the_widest() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, specs=[SlidingWindowSpec(8), SlidingWindowSpec(WINDOW)])
    request = _request("a", list(range(100, 140)))
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    _decode(kv, request)
    assert kv.num_held_blocks("a") == 11 - 25 // 4


def test_prefix_hit_on_slid_out_blocks_shares_and_frees_them_at_once() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, specs=SLIDING)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    assert kv.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    _decode(kv, first)  # slides out blocks 0..5, which stay cached
    assert kv.num_held_blocks("a") == 5
    slid_out = kv.block_ids("a")[:6]
    assert all(kv.blocks[b].ref_cnt == 0 and kv.blocks[b].block_hash is not None for b in slid_out)

    second = _request("b", prompt)
    hits, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 36 and [b.block_id for b in hits] == kv.block_ids("a")[:9]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(second, 40 - num_cached, hits)
    second.num_computed_tokens = 40
    # at 36 computed the window starts at 21: blocks 0..4 slide out at once; 5..8 shared, 9 new
    assert kv.num_held_blocks("b") == 5
    assert kv.block_ids("b")[:9] == kv.block_ids("a")[:9]
    assert kv.num_free_blocks == free_before - 2  # block 5 (cached, free) and one new block
    assert [kv.blocks[b].ref_cnt for b in kv.block_ids("a")[5:10]] == [1, 2, 2, 2, 1]
    _check_references(kv)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 32
    _check_references(kv)


def test_a_slid_out_block_handed_to_another_request_is_never_a_prefix_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, specs=SLIDING)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    assert kv.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    _decode(kv, first)  # 5 held, 11 free: 6 slid out (cached) and 5 never used
    other = _request("c", list(range(500, 532)))  # 8 blocks: takes the 5 unused, then 3 slid-out ones
    assert kv.allocate_slots(other, 32)
    taken = set(kv.block_ids("c"))
    assert len(taken & set(kv.block_ids("a")[:6])) == 3
    again = _request("b", prompt)
    hits, num_cached = kv.get_computed_blocks(again)
    assert not taken & {b.block_id for b in hits}
    # the slid-out blocks go out least recently freed first: the chain's head, so no hit
    assert num_cached == 0
    _check_references(kv)


def test_prefix_caching_off_and_no_specs_keep_the_old_behaviour() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, enable_prefix_caching=False, specs=None)
    request = _request("a", list(range(100, 140)))
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    for _ in range(9):
        _decode(kv, request)
    assert kv.num_held_blocks("a") == 13
    kv.free(request)
    assert kv.num_free_blocks == 32


def _step(scheduler: Scheduler, tables: dict[str, list[int]]) -> None:
    """One step; ``tables`` follows the block tables a worker builds from the step's messages."""
    out = scheduler.schedule()
    for req_id in out.finished_req_ids:
        tables.pop(req_id, None)
    for new in out.new_reqs:
        tables[new.req_id] = list(new.block_ids)
    for cached in out.cached_reqs:
        tables[cached.req_id] += cached.new_block_ids
    ids = list(out.num_scheduled_tokens)
    tokens = [7 if scheduler.requests[r].num_pending_tokens else None for r in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))


def test_scheduler_with_sliding_window_preempts_and_returns_every_block() -> None:
    """Long requests on few blocks: they only fit because blocks slide out; a shared prefix
    and preemptions along the way; every step's block lists stay consistent."""
    kv = KVCacheManager(num_blocks=14, block_size=BLOCK, specs=SLIDING)
    scheduler = Scheduler(SchedulerConfig(4, 24, 256), kv)
    shared = list(range(100, 124))
    requests = [_request(f"r{i}", shared + list(range(1000 * i, 1000 * i + 8 * i)), max_tokens=30) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    tables: dict[str, list[int]] = {}
    for _ in range(400):
        if not scheduler.num_unfinished:
            break
        _step(scheduler, tables)
        _check_references(kv)
        for request in scheduler.running:
            rid = request.request_id
            # never more than the window's blocks plus the step's own, whatever the length
            assert kv.num_held_blocks(rid) <= -(-(WINDOW + 24) // BLOCK) + 1
            assert len(kv.block_ids(rid)) == kv.num_blocks_for(request.num_computed_tokens)
            # the worker's append-only table names the manager's blocks, slid-out slots included
            assert tables[rid] == kv.block_ids(rid)
    assert not scheduler.num_unfinished
    assert all(len(r.output_token_ids) == 30 for r in requests)
    assert scheduler.num_preemptions > 0
    assert max(r.num_tokens for r in requests) > 14 * BLOCK  # longer than the whole cache
    assert kv.num_free_blocks == 14
    assert kv.stats.num_hits > 0
    _check_references(kv)
