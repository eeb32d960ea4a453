"""CpuAttentionBackend against sonar.attention.reference_attention on random paged steps."""

from __future__ import annotations

import pytest
import torch

from cpu_paged_step import PagedStep, make_step
from sonar.attention import reference_attention
from sonar_cpu import attention, attention_plan, native
from sonar_cpu.attention import CpuAttentionBackend
from sonar_cpu.attention_plan import split_into_buckets

# (context_lens, query_lens): decodes (query_len 1) first, then prefill chunks
LAYOUTS = {
    "decodes_only": ([5, 17, 0, 31, 64], [1, 1, 1, 1, 1]),
    "fresh_prefills": ([0, 0, 0], [1, 13, 40]),
    "prefills_over_cached_prefix": ([16, 7, 33], [9, 1 + 15, 31]),
    "mixed": ([3, 47, 15, 0, 20, 64], [1, 1, 1, 17, 5, 33]),
    "block_boundaries": ([15, 16, 31, 32, 12], [1, 1, 1, 1, 4]),
    "single_token_prefill": ([0, 9], [1, 1]),
    # a verify step: drafts after each context (short chunks, one decode row per token where the
    # C kernel runs), then a chunk just past the short limit and a fresh prefill
    "verify_steps": ([40, 5, 16, 63, 31, 0], [1, 8, 8, 16, 17, 12]),
}


@pytest.fixture
def sdpa_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes attended by the SDPA buckets, not the C kernel (which float32 steps take where
    it is built): for the tests of the buckets themselves."""
    monkeypatch.setattr("sonar_cpu.attention.native_library", lambda query, kv_cache: None)


def run_both(step: PagedStep, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    scale = head_dim**-0.5
    ref_cache = step.kv_cache.clone()
    expected = reference_attention(step.query, step.key, step.value, ref_cache, step.metadata, scale)
    backend = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    CpuAttentionBackend.prepare_metadata(step.metadata)
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)
    return actual, expected, step.kv_cache, ref_cache


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 32, 128, 96, 36])  # the C decode kernel: 64-column register blocks, 8-column, scalar
def test_matches_reference_fp32(layout: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    context_lens, query_lens = LAYOUTS[layout]
    step = make_step(
        context_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    actual, expected, cache, ref_cache = run_both(step, num_heads, num_kv_heads, head_dim)
    assert actual.shape == expected.shape == (step.metadata.num_tokens, num_heads, head_dim)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["mixed", "prefills_over_cached_prefix"])
def test_matches_reference_half_precision(dtype: torch.dtype, layout: str) -> None:
    context_lens, query_lens = LAYOUTS[layout]
    step = make_step(context_lens, query_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    actual, expected, cache, ref_cache = run_both(step, 9, 3, 64)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache, ref_cache)


def test_fp32_activations_over_bf16_cache() -> None:
    step = make_step([10, 0], [1, 12], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
    step.kv_cache = step.kv_cache.to(torch.bfloat16)
    actual, expected, cache, ref_cache = run_both(step, 4, 2, 32)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)


@pytest.mark.usefixtures("sdpa_decodes")
def test_decode_buckets_of_very_different_lengths() -> None:
    # two length clusters: the plan attends them in separate calls, in scattered row order
    context_lens = [300, 2, 310, 5, 290, 1, 305, 3]
    step = make_step(context_lens, [1] * 8, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    actual, expected, cache, ref_cache = run_both(step, 6, 2, 32)
    assert len(step.metadata.extra.decode_buckets) == 2
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("max_gather_bytes", [1, 60_000])
@pytest.mark.usefixtures("sdpa_decodes")
def test_decode_calls_split_by_gather_size(monkeypatch: pytest.MonkeyPatch, max_gather_bytes: int) -> None:
    # a call gathers at most MAX_GATHER_BYTES (at least one sequence): 1 byte -> one call each
    monkeypatch.setattr(attention_plan, "MAX_GATHER_BYTES", max_gather_bytes)
    context_lens, query_lens = LAYOUTS["mixed"]
    step = make_step(context_lens + [30, 33], [1] * 2 + query_lens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=4)
    actual, expected, cache, ref_cache = run_both(step, 6, 2, 32)
    buckets = step.metadata.extra.decode_buckets
    assert sum(b.seq_lens.numel() for b in buckets) == step.metadata.num_decodes == 5
    if max_gather_bytes == 1:
        assert len(buckets) == 5
    else:
        bytes_per_token = 2 * 2 * 32 * 4
        sizes = [(b.seq_lens.numel(), b.seq_lens.numel() * b.num_blocks * 4 * bytes_per_token) for b in buckets]
        assert all(n == 1 or size <= max_gather_bytes for n, size in sizes)
        assert 1 < len(buckets) < 5
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)


def test_one_plan_serves_every_layer() -> None:
    step = make_step([20, 0], [1, 9], num_heads=4, num_kv_heads=4, head_dim=32, block_size=4)
    backend = CpuAttentionBackend(4, 4, 32, 32**-0.5)
    CpuAttentionBackend.prepare_metadata(step.metadata)
    plan = step.metadata.extra
    for layer in range(3):
        layer_cache = step.kv_cache.clone()
        ref_cache = layer_cache.clone()
        expected = reference_attention(step.query, step.key, step.value, ref_cache, step.metadata, 32**-0.5)
        actual = backend.forward(step.query, step.key, step.value, layer_cache, step.metadata)
        assert step.metadata.extra is plan
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def reference_with_window(step: PagedStep, scale: float, window: int) -> torch.Tensor:
    """Windowed attention, written per token: query at position p sees keys (p - window, p]."""
    meta = step.metadata
    cache = step.kv_cache.clone()
    block_size = cache.shape[2]
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[0][meta.slot_mapping] = step.key
    flat[1][meta.slot_mapping] = step.value
    group = step.query.shape[1] // step.key.shape[1]
    out = torch.empty_like(step.query)
    for i in range(meta.num_seqs):
        start, end, seq_len = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], meta.seq_lens_cpu[i]
        for t in range(start, end):
            pos = seq_len - (end - t)
            keys_pos = range(max(0, pos - window + 1), pos + 1)
            slots = torch.tensor([int(meta.block_tables[i, p // block_size]) * block_size + p % block_size for p in keys_pos])
            k = flat[0][slots].repeat_interleave(group, 1)  # [n, heads, d]
            v = flat[1][slots].repeat_interleave(group, 1)
            weights = (torch.einsum("hd,khd->hk", step.query[t], k) * scale).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", weights, v)
    return out


def test_sliding_window() -> None:
    step = make_step([3, 40, 0, 25], [1, 1, 30, 12], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
    expected = reference_with_window(step, 32**-0.5, window=8)
    backend = CpuAttentionBackend(4, 2, 32, 32**-0.5, sliding_window=8)
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_split_into_buckets() -> None:
    assert split_into_buckets([]) == []
    assert split_into_buckets([300, 290, 310]) == [[0, 1, 2]]
    # 4 long + 60 short: padding the short ones to 800 costs far more than a second call
    lens = [800] * 4 + [50] * 60
    assert split_into_buckets(lens) == [list(range(4, 64)), list(range(4))]
    # every sequence in exactly one bucket
    lens = [int(x) for x in torch.randint(1, 900, (64,), generator=torch.Generator().manual_seed(1))]
    groups = split_into_buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(64))


def test_strided_views_of_a_fused_qkv_projection() -> None:
    # models split q, k, v out of one projection: the backend gets non-contiguous views
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    step = make_step([9, 30, 0], [1, 1, 11], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=4)
    fused = torch.cat([t.flatten(1) for t in (step.query, step.key, step.value)], dim=1)  # [T, (H + 2 KVH) * D]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = fused.split([q_size, kv_size, kv_size], dim=1)
    step.query = q.view(-1, num_heads, head_dim)
    step.key = k.view(-1, num_kv_heads, head_dim)
    step.value = v.view(-1, num_kv_heads, head_dim)
    assert not step.query.is_contiguous()
    actual, expected, cache, ref_cache = run_both(step, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("scattered", [True, False])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.usefixtures("sdpa_decodes")
def test_one_decode_attends_its_tokens_only(scattered: bool, window: int | None) -> None:
    # batch 1: the sequence is attended unpadded (no mask), read in place where its blocks are consecutive
    step = make_step([37], [1], num_heads=9, num_kv_heads=3, head_dim=32, block_size=4, scattered=scattered)
    scale = 32**-0.5
    expected = reference_with_window(step, scale, window) if window else reference_attention(
        step.query, step.key, step.value, step.kv_cache.clone(), step.metadata, scale
    )
    backend = CpuAttentionBackend(9, 3, 32, scale, sliding_window=window)
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)
    (bucket,) = step.metadata.extra.decode_buckets
    assert bucket.single_len == 38
    assert (bucket.first_block == 0) == (not scattered)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(native.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 36), (8, 1, 128), (12, 4, 40)])
@pytest.mark.parametrize("window", [None, 8, 100])
def test_the_c_decode_attention_matches_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None
) -> None:
    # decodes of many lengths (spans that are and are not multiples of the 8-wide vectors), two
    # prefill chunks after them; queries scaled up so that softmax underflows for most tokens
    context_lens, query_lens = [0, 6, 7, 15, 16, 63, 300, 1000, 24, 3], [1, 1, 1, 1, 1, 1, 1, 1, 7, 19]
    scale = head_dim**-0.5
    assert attention.native_library(torch.zeros(1), torch.zeros(1)) is not None
    outputs = []
    for use_native in (True, False):
        if not use_native:  # as the sdpa_decodes fixture does
            monkeypatch.setattr("sonar_cpu.attention.native_library", lambda query, kv_cache: None)
        step = make_step(context_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16)
        step.query.mul_(8.0)
        backend = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale, sliding_window=window)
        outputs.append(backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata))
    native_out, torch_out = outputs
    torch.testing.assert_close(native_out, torch_out, atol=1e-5, rtol=1e-4)  # float32 rounding of large scores


def test_the_c_decode_attention_leaves_other_dtypes_to_torch() -> None:
    assert attention.native_library(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)) is None
    assert attention.native_library(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)) is None
    assert attention.native_library(torch.zeros(1), torch.zeros(4, 4).t()) is None  # a cache that is not contiguous


@pytest.mark.skipif(native.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")
@pytest.mark.parametrize("window", [None, 6])
def test_short_chunks_go_to_the_c_kernel_as_decode_rows(window: int | None) -> None:
    # a verify step: each draft token is one decode row of its own length, in the decodes' call;
    # the chunk past SHORT_CHUNK_TOKENS and the fresh prefill stay prefills
    context_lens, query_lens = LAYOUTS["verify_steps"]
    step = make_step(context_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=4, scattered=True)
    scale = 32**-0.5
    expected = reference_with_window(step, scale, window) if window else reference_attention(
        step.query, step.key, step.value, step.kv_cache.clone(), step.metadata, scale
    )
    backend = CpuAttentionBackend(6, 2, 32, scale, sliding_window=window)
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)
    rows = step.metadata.extra.decode_rows
    assert attention_plan.SHORT_CHUNK_TOKENS == 16
    assert rows.num_rows == 1 + 8 + 8 + 16
    assert [chunk.end - chunk.start for chunk in rows.prefills] == [17, 12]
    assert rows.seq_lens[1:9].tolist() == list(range(6, 14))  # the drafts after 5 cached tokens: lengths 6..13
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def capped_reference(step: PagedStep, scale: float, cap: float, window: int | None = None) -> torch.Tensor:
    """The reference attention with Gemma 2's cap: each scaled score ``s`` as ``cap * tanh(s / cap)``."""
    return reference_attention(step.query, step.key, step.value, step.kv_cache.clone(), step.metadata, scale, window, logit_softcap=cap)


@pytest.mark.parametrize("layout", ["mixed", "verify_steps", "prefills_over_cached_prefix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("native_decodes", [True, False])
def test_scores_capped_as_gemma2_caps_them(monkeypatch: pytest.MonkeyPatch, layout: str, dtype: torch.dtype, window: int | None, native_decodes: bool) -> None:
    """Every path (the C kernel's decodes and short chunks, the SDPA buckets, prefill chunks with
    and without a context) caps the scores; a cap of 2 on scores of a few units changes them
    all, so a path that forgot it fails."""
    if not native_decodes:
        monkeypatch.setattr("sonar_cpu.attention.native_library", lambda query, kv_cache: None)
    elif native.load() is None:
        pytest.skip("no C compiler or no AVX2/FMA/F16C here")
    context_lens, query_lens = LAYOUTS[layout]
    step = make_step(context_lens, query_lens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype)
    step.query.mul_(4.0)  # scores of several units: the cap bends them
    scale, cap = 32**-0.5, 2.0
    expected = capped_reference(step, scale, cap, window)
    uncapped = reference_attention(step.query, step.key, step.value, step.kv_cache.clone(), step.metadata, scale, window)
    backend = CpuAttentionBackend(8, 2, 32, scale, sliding_window=window, logit_softcap=cap)
    actual = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert (expected.float() - uncapped.float()).abs().max() > 20 * tolerance  # the cap matters at these scores
