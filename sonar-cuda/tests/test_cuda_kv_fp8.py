"""The Triton kernels over an FP8 KV cache, E4M3 and E5M2: the write quantizes with the layer's
scales to the bytes torch's rounding gives; decode, prefill and the backend's mixed step read
FP8 and match their float32 references on the same FP8 cache."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
from paged_batch import assert_close, dtypes_for, make_paged_batch
from test_cuda_attention_backend import make_step, poison_outside_windows

from sonar.attention import reference_attention
from sonar_cuda.attention import TritonAttentionBackend
from sonar_cuda.kernels.decode_attention import decode_attention, reference_decode_attention
from sonar_cuda.kernels.kv_cache import reference_reshape_and_cache, reshape_and_cache
from sonar_cuda.kernels.prefill_attention import prefill_attention, reference_prefill_attention

K_SCALE, V_SCALE = 0.5, 0.125


@dataclass(frozen=True)
class Fp8Format:
    dtype: torch.dtype
    max: float  # the largest finite value
    smallest_normal: float  # below it the format is subnormal, in steps of subnormal_step
    subnormal_step: float
    rounding: float  # the largest relative error of rounding a normal value to nearest


E4M3 = Fp8Format(torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 1 / 16)
E5M2 = Fp8Format(torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 1 / 8)
FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def to_fp8(cache: torch.Tensor, scale: float, fmt: Fp8Format) -> torch.Tensor:
    return (cache.float() / scale).to(fmt.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 80)])
def test_write_quantizes_with_the_scales(num_kv_heads: int, head_dim: int, fmt: Fp8Format, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_blocks, page_size = 37, 6, 8
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(device)
    spread = 300 * fmt.max / E4M3.max  # some values beyond fmt.max * V_SCALE
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * spread).to(device)
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:num_tokens].to(device)
    slots[5] = -1  # a padding token: skipped
    caches = [torch.zeros(num_blocks, page_size, num_kv_heads, head_dim, dtype=fmt.dtype, device=device) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    reference_reshape_and_cache(key, value, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert caches[1].float().abs().max() == fmt.max, "values beyond the range saturate"
    for actual, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        normal = expected.float().abs() > fmt.smallest_normal
        assert torch.equal(actual.view(torch.uint8)[normal], expected.view(torch.uint8)[normal])
        # subnormals: at most one step apart
        torch.testing.assert_close(actual.float(), expected.float(), atol=fmt.subnormal_step, rtol=0)
    written = caches[0].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]].float() * K_SCALE
    torch.testing.assert_close(written, key[slots >= 0].float(), rtol=fmt.rounding, atol=fmt.smallest_normal * K_SCALE)


DECODE_CASES = [([1, 17, 33], 4, 4, 64, 16, None), ([130, 9], 4, 1, 64, 16, 3)]  # (seq_lens, H, KVH, D, page, splits)
PREFILL_CASES = [([(0, 5), (16, 17), (3, 1)], 4, 4, 64, 16), ([(31, 2), (8, 40)], 8, 2, 64, 8)]  # ((context, new), H, KVH, D, page)


def check_decode(seq_lens, num_heads, num_kv_heads, head_dim, page_size, num_splits, dtype, device, fmt=E4M3) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, torch.float32, device, gen)
    k_cache, v_cache = to_fp8(batch.k_cache, K_SCALE, fmt), to_fp8(batch.v_cache, V_SCALE, fmt)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    out = decode_attention(
        query, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE
    )
    expected = reference_decode_attention(query, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, K_SCALE, V_SCALE)
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


def check_prefill(chunks, num_heads, num_kv_heads, head_dim, page_size, dtype, device, fmt=E4M3) -> None:
    gen = torch.Generator().manual_seed(len(chunks) * 100 + head_dim)
    seq_lens = [context + new for context, new in chunks]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, torch.float32, device, gen)
    k_cache, v_cache = to_fp8(batch.k_cache, K_SCALE, fmt), to_fp8(batch.v_cache, V_SCALE, fmt)
    query_lens = [new for _, new in chunks]
    starts = torch.tensor([0] + [sum(query_lens[: i + 1]) for i in range(len(chunks))], dtype=torch.int32, device=device)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    out = prefill_attention(
        query, k_cache, v_cache, batch.block_tables, batch.seq_lens, starts, max(query_lens), scale, k_scale=K_SCALE, v_scale=V_SCALE
    )
    expected = reference_prefill_attention(query, k_cache, v_cache, batch.block_tables, batch.seq_lens, starts, scale, K_SCALE, V_SCALE)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_reads_fp8_small(case: tuple, fmt: Fp8Format, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check_decode(*case, dtype, device, fmt)


@pytest.mark.parametrize("launch", [(64, 2, 3), (128, 4, 2)])
def test_decode_reads_fp8_under_other_launch_shapes(launch: tuple[int, int, int], device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 cache's own tile, warps and stages (module constants a benchmark sets) read the
    same attention, split or not."""
    module = importlib.import_module("sonar_cuda.kernels.decode_attention")
    for name, value in zip(("FP8_BLOCK_N", "FP8_NUM_WARPS", "FP8_NUM_STAGES"), launch):
        monkeypatch.setattr(module, name, value)
    for case in DECODE_CASES:
        check_decode(*case, dtypes_for(device)[-1], device)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_reads_fp8_small(case: tuple, fmt: Fp8Format, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check_prefill(*case, dtype, device, fmt)


def check_step(decode_lens, chunks, num_heads, num_kv_heads, head_dim, dtype, device, window=None, fmt=E4M3) -> None:
    """The backend's mixed step over an FP8 cache against sonar's reference attention on it."""
    gen = torch.Generator().manual_seed(sum(decode_lens) + head_dim + 1)
    metadata, num_blocks = make_step(decode_lens, chunks, 16, device, gen)
    kv_cache = torch.randn(2, num_blocks, 16, num_kv_heads, head_dim, generator=gen).to(fmt.dtype).to(device)
    qkv = torch.randn(metadata.num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    scale = head_dim**-0.5
    expected_cache = kv_cache.clone()
    expected = reference_attention(query.float(), key, value, expected_cache, metadata, scale, window, K_SCALE, V_SCALE)
    if window is not None:
        poison_outside_windows([kv_cache, expected_cache], metadata, num_blocks, window)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, sliding_window=window)
    TritonAttentionBackend.prepare_metadata(metadata)
    out = backend.forward(query, key, value, kv_cache, metadata, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == dtype
    written = kv_cache.float().nan_to_num(7.0) - expected_cache.float().nan_to_num(7.0)
    assert written.abs().max() <= fmt.subnormal_step, "the new keys and values land in their slots, quantized"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_step_over_fp8_small(fmt: Fp8Format, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check_step([1, 17], [(0, 5), (16, 3)], 4, 2, 64, dtype, device, fmt=fmt)
    check_step([1, 17, 70], [(0, 45), (30, 20)], 4, 2, 32, torch.float32, device, window=16, fmt=fmt)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernels_large(dtype: torch.dtype, fmt: Fp8Format, device: torch.device) -> None:
    check_decode([1, 15, 16, 17, 255, 1000, 3071], 32, 8, 128, 16, None, dtype, device, fmt)
    check_decode([4097, 33], 32, 8, 128, 16, 8, dtype, device, fmt)
    check_prefill([(0, 1), (16, 16), (100, 257), (0, 1023), (2048, 129)], 32, 8, 128, 16, dtype, device, fmt)
    check_step([1, 16, 1025, 300] * 8, [(0, 512), (1000, 77)], 32, 8, 128, dtype, device, fmt=fmt)
    check_step([1, 17, 1025, 300] * 4, [(0, 512), (4000, 300)], 16, 8, 128, dtype, device, window=256, fmt=fmt)
