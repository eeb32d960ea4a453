"""The drafters' paged KV cache: blocks and rows come back when a request leaves (finished,
preempted or aborted all reach ``remove``) and are reused; reads through the block table give
the same attention as the per-request caches it replaced, for requests whose blocks
interleave in the pool; a padded pass (``DraftPass`` at a captured size) equals the pass at
its own shape."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from sonar.spec_decode.dflash_cache import ContextKVCache
from sonar.spec_decode.draft_graphs import DraftPass, ReplayCapturer, capture_sizes, slot_buckets
from sonar.spec_decode.eagle3_cache import DraftKVCache
from sonar.spec_decode.interface import DraftCacheBudget
from sonar.spec_decode.paged_draft_cache import SCRATCH_BLOCK, PagedDraftCache, build_draft_cache, pool_blocks_for

CPU = torch.device("cpu")


def paged(num_layers: int = 2, num_blocks: int = 8, max_requests: int = 3, max_slots: int = 40) -> PagedDraftCache:
    return PagedDraftCache(num_layers, 2, 8, torch.float32, CPU, block_size=4, num_blocks=num_blocks, max_requests=max_requests, max_slots_per_request=max_slots)


def test_blocks_and_rows_are_reused_after_a_request_leaves():
    cache = paged()
    gen = torch.Generator().manual_seed(0)
    cache.append("a", torch.randn(2, 2, 6, 2, 8, generator=gen))  # 2 blocks
    cache.append("b", torch.randn(2, 2, 9, 2, 8, generator=gen))  # 3 blocks
    assert cache.num_free_blocks == 3 and cache.num_requests == 2
    used_by_b = set(cache.table[cache.row_of("b"), :3].tolist())
    assert SCRATCH_BLOCK not in used_by_b
    for req_id in ("a", "b"):  # finished, preempted, aborted: the runner removes each the same way
        cache.remove(req_id)
    assert cache.num_free_blocks == 8 and cache.num_requests == 0
    assert cache.table.eq(SCRATCH_BLOCK).all() and cache.device_lengths[:-1].eq(0).all()
    assert "a" not in cache.lengths and "b" not in cache.committed
    # the same pool serves new requests, over and over, without running short
    for round_ in range(20):
        for req_id in ("c", "d", "e"):
            cache.append(f"{req_id}{round_}", torch.randn(2, 2, 10, 2, 8, generator=gen))  # 3 blocks each: two fit
            if cache.num_free_blocks < 3:
                break
        for req_id in list(cache.lengths):
            cache.remove(req_id)
        assert cache.num_free_blocks == 8
    cache.remove("never seen")  # ignored


def test_limits_are_clear_errors():
    cache = paged(num_blocks=3, max_requests=2, max_slots=8)
    with pytest.raises(ValueError, match="more than the 8 one request may hold"):
        cache.append("a", torch.zeros(2, 2, 9, 2, 8))
    cache.append("a", torch.zeros(2, 2, 8, 2, 8))
    with pytest.raises(RuntimeError, match="out of blocks"):
        cache.append("b", torch.zeros(2, 2, 5, 2, 8))
    cache.append("b", torch.zeros(2, 2, 4, 2, 8))
    with pytest.raises(RuntimeError, match="holds 2 requests already"):
        cache.append("c", torch.zeros(2, 2, 1, 2, 8))


def test_the_pool_sized_from_the_target_budget_holds_what_the_target_holds():
    assert pool_blocks_for(100, 4, 16, 3) == 100 + 4 * 2
    budget = DraftCacheBudget(num_target_blocks=10, block_size=4, max_num_seqs=2, max_model_len=40)
    cache = build_draft_cache(budget, 1, 2, 8, torch.float32, CPU, num_temporary_slots=3)
    assert cache.num_blocks == 14 and cache.max_blocks_per_request == 11 and cache.max_requests == 2
    # two requests at full length with their guesses fit where the target's 10 blocks hold them
    cache.append("a", torch.zeros(1, 2, 20, 2, 8))
    cache.append("b", torch.zeros(1, 2, 20, 2, 8))
    cache.reserve("a", 23)
    cache.reserve("b", 23)


@torch.inference_mode()
def test_one_query_attention_equals_the_per_request_cache():
    gen = torch.Generator().manual_seed(1)
    old = DraftKVCache(num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
    cache = paged(num_layers=1, num_blocks=12, max_slots=24)
    lengths = {"a": 0, "b": 0, "c": 0}
    for chunk in ([5, 3, 7], [1, 6, 2], [4, 1, 3]):  # interleaved writes: the rows' blocks interleave in the pool
        for req_id, n in zip(lengths, chunk):
            k, v = torch.randn(2, n, 2, 8, generator=gen)
            old.append(req_id, k, v, commit=True)
            cache.append(req_id, torch.stack([k, v])[None])
            lengths[req_id] += n
    queries = torch.randn(3, 4, 8, generator=gen)  # 4 query heads over 2 KV heads
    rows = torch.tensor([cache.row_of(r) for r in lengths])
    longest = max(lengths.values())
    got = cache.attend(0, rows, queries, cache.device_lengths[rows], longest + 5, scale=0.3)  # reads past every row
    for i, req_id in enumerate(lengths):
        # the old cache attends its last slot; give it a query at its last slot
        expected = old.attend(req_id, queries[i : i + 1], scale=0.3)
        torch.testing.assert_close(got[i : i + 1], expected, rtol=1e-5, atol=1e-6)
    # a guessed slot written at device-computed slots is seen, then dropped by not committing
    k, v = torch.randn(2, 3, 2, 8, generator=gen)
    seen = cache.device_lengths[rows]
    cache.reserve("a", lengths["a"] + 1), cache.reserve("b", lengths["b"] + 1), cache.reserve("c", lengths["c"] + 1)
    cache.write_rows(0, rows, seen, k, v)
    got = cache.attend(0, rows, queries, seen + 1, longest + 1, scale=0.3)
    for i, req_id in enumerate(lengths):
        old.append(req_id, k[i : i + 1], v[i : i + 1], commit=False)
        torch.testing.assert_close(got[i : i + 1], old.attend(req_id, queries[i : i + 1], scale=0.3), rtol=1e-5, atol=1e-6)
        old.rollback(req_id)
    assert cache.device_lengths[rows].tolist() == list(lengths.values())


@torch.inference_mode()
def test_context_reads_equal_the_per_request_context_cache():
    gen = torch.Generator().manual_seed(2)
    old = ContextKVCache(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
    cache = paged(num_layers=2, num_blocks=12, max_slots=24)
    positions = {"a": 0, "b": 10, "c": 3}
    for chunk in ([5, 3, 7], [1, 6, 2], [4, 1, 3]):
        for req_id, n in zip(positions, chunk):
            kv = torch.randn(2, 2, n, 2, 8, generator=gen)
            where = torch.arange(positions[req_id], positions[req_id] + n) * 2  # positions with gaps
            old.append(req_id, [(kv[layer, 0], kv[layer, 1]) for layer in range(2)], where)
            cache.append(req_id, kv, where)
            positions[req_id] += n + 1
    req_ids = list(positions)
    context, old_positions, valid = old.gather(req_ids)
    rows = torch.tensor([cache.row_of(r) for r in req_ids])
    longest = valid.shape[1]
    new_valid = torch.arange(longest)[None, :] < cache.device_lengths[rows][:, None]
    assert torch.equal(new_valid, valid)
    new_positions = cache.read_positions(rows, longest)
    assert torch.equal(new_positions[valid], old_positions[valid])
    queries = torch.randn(3, 4, 5, 8, generator=gen)  # [R, H, Q, D]
    mask = valid[:, None, None, :].expand(3, 1, 5, longest)
    for layer, ((keys, values), (new_keys, new_values)) in enumerate(zip(context, cache.layers(rows, longest))):
        assert torch.equal(new_keys[valid], keys[valid]) and torch.equal(new_values[valid], values[valid])
        expected = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        got = F.scaled_dot_product_attention(queries, new_keys.transpose(1, 2), new_values.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_shapes_the_core_chooses():
    assert capture_sizes(256, 32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(256, 1 << 30) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(100, 1 << 30) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(3, 32) == [1, 2, 3]
    assert slot_buckets(16, 100) == [16, 32, 64, 112]
    assert slot_buckets(16, 1 << 20)[-1] == 8192


@torch.inference_mode()
def test_a_padded_pass_equals_the_pass_at_its_own_shape():
    gen = torch.Generator().manual_seed(3)
    cache = paged(num_layers=1, num_blocks=20, max_requests=6, max_slots=30)
    for req_id, n in (("a", 7), ("b", 13), ("c", 2)):
        cache.append(req_id, torch.randn(1, 2, n, 2, 8, generator=gen))
        cache.reserve(req_id, n + 2)

    def fn(inputs, num_slots):
        rows = inputs["rows"]
        seen = cache.device_lengths[rows]
        out = cache.attend(0, rows, inputs["queries"], seen, num_slots, 0.5)
        k = v = out[:, :2] * 0.5  # a guessed slot of each row, from its own output
        cache.write_rows(0, rows, seen, k, v)
        return (cache.attend(0, rows, inputs["queries"], seen + 1, num_slots + 1, 0.5),)

    inputs = {"rows": torch.full((4,), cache.padding_row), "queries": torch.zeros(4, 4, 8)}
    padding = {"rows": cache.padding_row, "queries": 0.0}
    eager = DraftPass("test", fn, inputs, padding, extra_slots=1)
    padded = DraftPass("test", fn, {name: t.clone() for name, t in inputs.items()}, padding, extra_slots=1)
    capturer = ReplayCapturer()
    padded.capture(capturer, [2, 4], slot_buckets(4, 30))
    assert capturer.num_captured == 2 * 4 and padded.shape_for(3, 14) == (4, 16) and padded.shape_for(5, 4) is None
    values = {"rows": torch.tensor([cache.row_of(r) for r in ("a", "b", "c")]), "queries": torch.randn(3, 4, 8, generator=gen)}
    (expected,) = eager.run(values, 13)
    (got,) = padded.run(values, 13)  # size 4, 16 slots: one padding row, reads past every row
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert padded.inputs["rows"][3].item() == cache.padding_row


@torch.inference_mode()
def test_large_batches_are_captured_over_fewer_slots():
    """64 requests are captured up to a quarter of the slots 16 are, 256 up to a sixteenth
    (the same largest gather); a pass past that runs eagerly."""
    draft = DraftPass("test", lambda inputs, num_slots: (inputs["x"] * 2,), {"x": torch.zeros(256, 3)}, {"x": 0.0})
    capturer = ReplayCapturer()
    draft.capture(capturer, [16, 64, 256], [16, 512, 2048, 8192])
    assert capturer.num_captured == 9  # all but (64, 8192), (256, 2048) and (256, 8192)
    assert draft.shape_for(40, 2000) == (64, 2048) and draft.shape_for(10, 8000) == (16, 8192)
    assert draft.shape_for(200, 400) == (256, 512)
    assert draft.shape_for(40, 3000) is None and draft.shape_for(200, 600) is None


class _FailingCapturer(ReplayCapturer):
    """A platform whose graphs cannot hold the pass (an op that is not capturable, say)."""

    def capture(self, run):
        if self.num_captured == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(run)


@torch.inference_mode()
def test_a_pass_that_cannot_be_captured_runs_eagerly():
    calls = []

    def fn(inputs, num_slots):
        calls.append((inputs["x"].shape[0], num_slots))
        return (inputs["x"] * 2,)

    draft = DraftPass("test", fn, {"x": torch.zeros(4, 3)}, {"x": 0.0})
    draft.capture(_FailingCapturer(), [2, 4], [16, 32])
    assert not draft.captured and draft.shape_for(1, 8) is None
    calls.clear()
    x = torch.arange(6.0).view(2, 3)
    (out,) = draft.run({"x": x}, 8)
    assert torch.equal(out, x * 2) and calls == [(2, 8)]  # at its own shape, not a padded one


def test_claiming_many_requests_at_once_equals_one_append_each():
    """The drafter commits every request's new states in one call: the same slots, positions,
    lengths and device rows as one append per request (a request with no new state untouched)."""
    gen = torch.Generator().manual_seed(3)
    rounds = [(["a", "b", "c"], [5, 0, 3]), (["a", "b", "c"], [2, 7, 1]), (["c", "a"], [12, 1])]
    one_by_one, at_once = paged(num_blocks=16), paged(num_blocks=16)
    for req_ids, counts in rounds:
        kv = torch.randn(2, 2, sum(counts), 2, 8, generator=gen)
        positions = torch.arange(sum(counts)) + 100
        start = 0
        for req_id, count in zip(req_ids, counts):
            if count:
                one_by_one.append(req_id, kv[:, :, start : start + count], positions[start : start + count])
            start += count
        slots = at_once.claim_many(req_ids, counts)
        at_once.write_slots(slots, [(kv[layer, 0], kv[layer, 1]) for layer in range(2)], positions)
    assert at_once.lengths == one_by_one.lengths and at_once.committed == one_by_one.committed
    assert torch.equal(at_once.table, one_by_one.table)  # the blocks handed out in one table write
    wanted = [("a", at_once.lengths["a"] + 9), ("b", at_once.lengths["b"] + 3)]
    at_once.reserve_many(wanted)
    for req_id, num_slots in wanted:
        one_by_one.reserve(req_id, num_slots)
    assert torch.equal(at_once.table, one_by_one.table)
    for req_id in ("a", "b", "c"):
        num_slots = at_once.lengths[req_id]
        got_row, want_row = torch.tensor([at_once.row_of(req_id)]), torch.tensor([one_by_one.row_of(req_id)])
        for got, want in zip(at_once.read(1, got_row, num_slots), one_by_one.read(1, want_row, num_slots)):
            assert torch.equal(got, want)
        assert torch.equal(at_once.read_positions(got_row, num_slots), one_by_one.read_positions(want_row, num_slots))
        assert at_once.device_lengths[got_row] == one_by_one.device_lengths[want_row]
