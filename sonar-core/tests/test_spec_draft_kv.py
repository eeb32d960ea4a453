"""The draft model's KV cache: blocks on demand, taken back from the least recently drafted
request when the pool runs short, never from a request of the same call."""

from __future__ import annotations

import torch
from sonar.spec_decode.draft_kv import DraftKVCache


def cache(num_blocks: int = 6, max_blocks_per_seq: int = 4) -> DraftKVCache:
    return DraftKVCache(2, 2, 8, torch.float32, 4, num_blocks, max_blocks_per_seq, torch.device("cpu"))


def test_the_pool_is_allocated_once_and_sized_by_its_blocks():
    kv = cache()
    assert [tuple(c.shape) for c in kv.kv_caches] == [(2, 6, 4, 2, 8)] * 2
    assert kv.num_bytes == 2 * (2 * 6 * 4 * 2 * 8) * 4
    assert kv.num_free_blocks == 6


def test_requests_grow_block_by_block_and_give_blocks_back():
    kv = cache()
    assert kv.allocate("a", 5, {"a"}) == []  # 5 tokens: 2 blocks
    assert kv.block_table.num_blocks_of["a"] == 2 and kv.num_free_blocks == 4
    assert kv.allocate("a", 8, {"a"}) == [] and kv.num_free_blocks == 4  # still 2 blocks
    assert kv.allocate("a", 9, {"a"}) == [] and kv.block_table.num_blocks_of["a"] == 3
    blocks = kv.block_table.gather(["a"], 3)[0].tolist()
    assert len(set(blocks)) == 3
    kv.free("a")
    assert kv.num_free_blocks == 6 and "a" not in kv.block_table.row_of
    kv.free("a")  # twice: nothing happens
    assert kv.num_free_blocks == 6


def test_a_short_pool_takes_blocks_back_from_the_least_recently_drafted_request_outside_the_call():
    kv = cache()
    kv.allocate("old", 8, {"old"})
    kv.allocate("new", 8, {"new"})
    kv.allocate("old", 8, {"old"})  # drafted again: now the most recent
    assert kv.num_free_blocks == 2
    assert kv.allocate("third", 12, {"third"}) == ["new"]
    assert kv.block_table.num_blocks_of["third"] == 3 and "new" not in kv.block_table.row_of
    # the call's own requests are kept: no room then, and the request holds nothing
    assert kv.allocate("fourth", 16, {"fourth", "old", "third"}) is None
    assert "fourth" not in kv.block_table.row_of and kv.num_free_blocks == 1


def test_a_sequence_longer_than_the_drafters_context_gets_no_blocks():
    kv = cache(num_blocks=8, max_blocks_per_seq=2)
    assert kv.allocate("long", 9, {"long"}) is None
    assert kv.num_free_blocks == 8
