"""The paged KV-cache manager: allocation, reference counts, prefix caching, LRU eviction."""

from __future__ import annotations

from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request
from sonar.sampling_params import SamplingParams


def _request(request_id: str, tokens: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), [0], max_tokens)


def _admit(kv: KVCacheManager, request: Request) -> int:
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_allocate_and_free_return_every_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = _request("a", list(range(10)))
    assert _admit(kv, request) == 0
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 7
    # decode: the 11th and 12th tokens fit the third block, the 13th needs a fourth
    for token in (10, 11, 12):
        request.output_token_ids.append(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert len(kv.block_ids("a")) == 4
    kv.free(request)
    assert kv.num_free_blocks == 10


def test_shared_prefix_hits_full_blocks_and_counts_references() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = _request("a", list(range(12)) + [100])
    _admit(kv, first)
    second = _request("b", list(range(12)) + [200, 201])
    assert _admit(kv, second) == 12
    assert kv.block_ids("a")[:3] == kv.block_ids("b")[:3]
    assert all(kv.blocks[b].ref_cnt == 2 for b in kv.block_ids("a")[:3])
    kv.free(first)
    assert all(kv.blocks[b].ref_cnt == 1 for b in kv.block_ids("b")[:3])
    kv.free(second)
    assert kv.num_free_blocks == 16
    # freed blocks stay findable
    third = _request("c", list(range(12)) + [300])
    assert _admit(kv, third) == 12


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _admit(kv, _request("a", list(range(8))))
    again = _request("b", list(range(8)))
    assert _admit(kv, again) == 4  # the second block holds the last token: recomputed


def test_lru_evicts_the_least_recently_freed_blocks_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old = _request("old", list(range(8)) + [1])
    _admit(kv, old)
    kv.free(old)
    new = _request("new", list(range(50, 58)) + [1])
    _admit(kv, new)  # needs three blocks: the old prefix is partly evicted
    kv.free(new)
    probe = _request("probe", list(range(50, 58)) + [2])
    assert _admit(kv, probe) == 8


def test_allocation_fails_cleanly_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = _request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _admit(kv, _request("a", list(range(9))))
    assert _admit(kv, _request("b", list(range(9)))) == 0
