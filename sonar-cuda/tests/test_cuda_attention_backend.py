"""The Triton backend on a mixed step (decodes first, then prefill chunks) against sonar's
reference paged attention, with full attention, with sliding windows and with soft-capped scores."""

from __future__ import annotations

import pytest
import torch
from paged_batch import TOLERANCE, assert_close, dtypes_for

from sonar.attention import AttentionMetadata, reference_attention
from sonar_cuda.attention import TritonAttentionBackend


def make_step(
    decode_lens: list[int], chunks: list[tuple[int, int]], page_size: int, device: torch.device, gen: torch.Generator
) -> tuple[AttentionMetadata, int]:
    """Metadata for decodes of ``decode_lens`` (context + 1) then ``(context, new)`` prefill chunks."""
    seq_lens = decode_lens + [context + new for context, new in chunks]
    query_lens = [1] * len(decode_lens) + [new for _, new in chunks]
    pages_per_seq = [(n + page_size - 1) // page_size for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    slot_mapping: list[int] = []
    for i, (seq_len, q_len, num_pages) in enumerate(zip(seq_lens, query_lens, pages_per_seq)):
        pages, free = free[:num_pages], free[num_pages:]
        block_tables[i, :num_pages] = torch.tensor(pages, dtype=torch.int32)
        slot_mapping += [pages[p // page_size] * page_size + p % page_size for p in range(seq_len - q_len, seq_len)]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        num_decodes=len(decode_lens),
        num_decode_tokens=len(decode_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return metadata, num_blocks


def poison_outside_windows(kv_caches: list[torch.Tensor], metadata: AttentionMetadata, num_blocks: int, window: int) -> None:
    """What a kernel finds where the KV-cache manager gave blocks back: NaN in every cached
    slot before the first window start of each sequence, and, for blocks wholly before it,
    the id of a spare block full of NaN in the block table. A kernel that reads there fails."""
    page_size = kv_caches[0].shape[2]
    tables = metadata.block_tables.cpu()
    used = {int(b) for i, n in enumerate(metadata.seq_lens_cpu) for b in tables[i, : -(-n // page_size)]}
    spare = min(set(range(num_blocks)) - used)
    for kv_cache in kv_caches:
        kv_cache[:, spare] = float("nan")
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        window_start = max(seq_len - (starts[i + 1] - starts[i]) - window + 1, 0)
        for position in range(window_start):
            for kv_cache in kv_caches:
                kv_cache[:, int(tables[i, position // page_size]), position % page_size] = float("nan")
        tables[i, : window_start // page_size] = spare
    metadata.block_tables = tables.to(metadata.block_tables.device)


def check(
    decode_lens: list[int],
    chunks: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None = None,
    num_splits: int | None = None,
    logit_softcap: float | None = None,
    query_gain: float = 1.0,
) -> None:
    """Compare one step with the reference; ``query_gain`` scales the queries (and so the scores)."""
    gen = torch.Generator().manual_seed(sum(decode_lens) + head_dim)
    page_size = 16
    metadata, num_blocks = make_step(decode_lens, chunks, page_size, device, gen)
    kv_cache = torch.randn(2, num_blocks, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    # q, k, v as views of one fused projection, as models produce them
    qkv = torch.randn(metadata.num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv[:, :num_heads] *= query_gain
    qkv = qkv.to(dtype).to(device)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    scale = head_dim**-0.5
    expected_cache = kv_cache.clone()
    expected = reference_attention(
        query.float(), key, value, expected_cache, metadata, scale, window, logit_softcap=logit_softcap
    )
    if logit_softcap is not None:
        uncapped = reference_attention(query.float(), key, value, kv_cache.clone(), metadata, scale, window)
        assert (uncapped - expected).abs().max() > 2 * TOLERANCE[dtype], "a backend ignoring the cap would pass"
    if window is not None:
        poison_outside_windows([kv_cache, expected_cache], metadata, num_blocks, window)

    backend = TritonAttentionBackend(
        num_heads, num_kv_heads, head_dim, scale, sliding_window=window, logit_softcap=logit_softcap
    )
    TritonAttentionBackend.prepare_metadata(metadata)
    metadata.extra.decode_num_splits = num_splits
    out = backend.forward(query, key, value, kv_cache, metadata)
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.equal(kv_cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0)), "keys and values must land in their slots"
    assert_close(out, expected, dtype)


def test_mixed_step_small(device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check([1, 17], [(0, 5), (16, 3)], 4, 2, 64, dtype, device)  # decodes + prefills
        check([], [(3, 20)], 8, 1, 128, dtype, device)  # prefill only
        check([30, 2, 16], [], 8, 8, 64, dtype, device)  # decode only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_step_large(dtype: torch.dtype, device: torch.device) -> None:
    check([1, 16, 17, 1025, 300] * 10, [(0, 512), (1000, 77), (16, 1), (33, 1024)], 16, 8, 128, dtype, device)
    check([4000, 5], [(0, 2048)], 32, 8, 128, dtype, device)
    check([63] * 64, [(0, 100), (10, 90)], 32, 4, 64, dtype, device)


def test_sliding_window_small(device: torch.device) -> None:
    """Windows shorter than a page, than a tile and than the context; blocks before every
    window hold NaN or are stale ids, so anything read there fails the comparison."""
    for dtype in dtypes_for(device):
        check([1, 17, 70], [(0, 45), (30, 20), (100, 3)], 4, 2, 32, dtype, device, window=5)
        check([9, 40], [(0, 70), (50, 40)], 4, 1, 32, dtype, device, window=16)
        check([200], [(90, 75)], 2, 2, 32, dtype, device, window=40)


def test_sliding_window_split_decode(device: torch.device) -> None:
    """The split-KV decode divides the window, not the context, among its splits (a fixed
    split count, as CUDA graphs use, and the count the backend picks)."""
    check([300, 130, 5], [], 4, 2, 32, torch.float32, device, window=100, num_splits=3)
    check([300], [], 4, 2, 32, torch.float32, device, window=150)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sliding_window_large(dtype: torch.dtype, device: torch.device) -> None:
    check([1, 17, 1025, 300] * 8, [(0, 512), (1000, 77), (4000, 300)], 16, 8, 128, dtype, device, window=256)
    check([5000, 70] * 4, [(0, 2048)], 32, 8, 128, dtype, device, window=1000)
    check([5000] * 2, [], 32, 8, 128, dtype, device, window=4096, num_splits=16)


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window=0"):
        TritonAttentionBackend(4, 2, 64, 0.125, sliding_window=0)


@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
def test_soft_cap_small(logit_softcap: float, device: torch.device) -> None:
    """Capped scores (queries scaled by 8, scores up to about 25) in a mixed step, under a
    sliding window (NaN before it) and in the split-KV decode."""
    capped = {"logit_softcap": logit_softcap, "query_gain": 8.0}
    for dtype in dtypes_for(device):
        check([1, 17], [(0, 5), (16, 3)], 4, 2, 64, dtype, device, **capped)
        check([1, 17, 70], [(0, 45), (30, 20)], 4, 2, 32, dtype, device, window=16, **capped)
    check([300, 130, 5], [], 4, 2, 32, torch.float32, device, window=100, num_splits=3, **capped)
    check([130, 9], [], 4, 1, 64, torch.float32, device, num_splits=3, **capped)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("logit_softcap", [50.0, 5.0])
def test_soft_cap_large(logit_softcap: float, dtype: torch.dtype, device: torch.device) -> None:
    capped = {"logit_softcap": logit_softcap, "query_gain": 8.0}
    check([1, 17, 1025, 300] * 8, [(0, 512), (1000, 77)], 16, 8, 128, dtype, device, **capped)
    check([1, 17, 1025, 300] * 8, [(0, 512), (4000, 300)], 16, 8, 128, dtype, device, window=256, **capped)
    check([5000] * 2, [], 32, 8, 128, dtype, device, window=4096, num_splits=16, **capped)


@pytest.mark.parametrize("logit_softcap", [0.0, -30.0])
def test_a_cap_not_above_zero_is_refused(logit_softcap: float) -> None:
    with pytest.raises(ValueError, match=f"logit_softcap={logit_softcap}"):
        TritonAttentionBackend(4, 2, 64, 0.125, logit_softcap=logit_softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("arch, overrides", [
    ("mistral", {"sliding_window": 32}),  # every layer slides: blocks are given back
    ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),  # layer 0 full, layer 1 slides
])
def test_sliding_window_engine_greedy_equals_transformers(tmp_path, arch: str, overrides: dict) -> None:
    """Windows shorter than the prompts, float32, through the decode graphs and chunked
    prefills: greedy equals transformers, and every block comes back."""
    from engine_helpers import HFOracle, generate, random_prompts, use_tokenizer_folder_if_needed

    from sonar.sampling_params import SamplingParams
    from sonar_cuda.platform import CudaPlatform
    from sonar_models.testing import build_tiny_model

    use_tokenizer_folder_if_needed()
    path = build_tiny_model(arch, tmp_path / arch, **overrides)
    prompts = random_prompts(12, seed=5, min_len=40, max_len=140)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    oracle = HFOracle(path)
    expected = [oracle.greedy(prompt, 40) for prompt in prompts]
    for budget in (None, 48):  # 48: prefill chunks mixed with decodes
        outputs, engine = generate(
            CudaPlatform, path, prompts, params,
            dtype="float32", max_model_len=512, max_num_batched_tokens=budget, kv_cache_memory_bytes=64 << 20,
        )
        assert engine.core.executor.worker.model_runner.graphs.graphs, "decode graphs were captured"
        assert [output.outputs[0].token_ids for output in outputs] == expected
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
