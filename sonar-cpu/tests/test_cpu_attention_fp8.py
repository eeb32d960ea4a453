"""The CPU backend over an FP8 KV cache, E4M3 and E5M2: against the reference attention on the
same FP8 cache (same stored bytes, same outputs), and against the float32 cache (the
quantization error)."""

from __future__ import annotations

import pytest
import torch

from cpu_paged_step import PagedStep, make_step
from sonar.attention import reference_attention
from sonar_cpu.attention import CpuAttentionBackend

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = [pytest.param(FP8, id="e4m3"), pytest.param(E5M2, id="e5m2")]
# (context_lens, query_lens): decodes first, then fresh prefills and chunks over a cached prefix
LAYOUTS = {
    "mixed": ([3, 47, 15, 0, 20, 64], [1, 1, 1, 17, 5, 33]),
    "decodes_only": ([5, 17, 31, 64], [1, 1, 1, 1]),
    "fresh_prefills": ([0, 0], [13, 40]),
}


def fp8_step(layout: str, dtype: torch.dtype, fp8: torch.dtype = FP8, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 32) -> PagedStep:
    """A step whose cached context is stored in ``fp8`` (with scale 0.5 for keys, 0.25 for values)."""
    context_lens, query_lens = LAYOUTS[layout]
    step = make_step(context_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, dtype=dtype)
    step.kv_cache = torch.stack([(step.kv_cache[0].float() / 0.5).to(fp8), (step.kv_cache[1].float() / 0.25).to(fp8)])
    return step


def run(step: PagedStep, backend_cache: torch.Tensor, k_scale: float, v_scale: float, window: int | None = None) -> torch.Tensor:
    num_heads, head_dim = step.query.shape[1:]
    backend = CpuAttentionBackend(num_heads, step.key.shape[1], head_dim, head_dim**-0.5, sliding_window=window)
    CpuAttentionBackend.prepare_metadata(step.metadata)
    return backend.forward(step.query, step.key, step.value, backend_cache, step.metadata, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 9])
def test_fp8_cache_matches_reference_fp32(layout: str, window: int | None, fp8: torch.dtype) -> None:
    step = fp8_step(layout, torch.float32, fp8)
    ref_cache = step.kv_cache.clone()
    expected = reference_attention(
        step.query, step.key, step.value, ref_cache, step.metadata, 32**-0.5, window, k_scale=0.5, v_scale=0.25
    )
    actual = run(step, step.kv_cache, 0.5, 0.25, window)
    assert step.kv_cache.dtype == fp8
    assert torch.equal(step.kv_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "the same FP8 bytes in the same slots"
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", FORMATS)
def test_fp8_cache_with_bf16_activations(fp8: torch.dtype) -> None:
    step = fp8_step("mixed", torch.bfloat16, fp8)
    expected = reference_attention(
        step.query, step.key, step.value, step.kv_cache.clone(), step.metadata, 32**-0.5, k_scale=0.5, v_scale=0.25
    )
    actual = run(step, step.kv_cache, 0.5, 0.25)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "fp8, rounding, mean_error", [pytest.param(FP8, 1 / 16, 0.01, id="e4m3"), pytest.param(E5M2, 1 / 8, 0.025, id="e5m2")]
)
def test_fp8_cache_stays_close_to_the_float32_cache(fp8: torch.dtype, rounding: float, mean_error: float) -> None:
    """Unit-variance keys and values stored in FP8 (``rounding``: the relative error, 1/16 with
    E4M3's 3 mantissa bits, 1/8 with E5M2's 2) move the attention output by under
    ``mean_error`` on average (0.01 for E4M3, about twice that for E5M2); at most by
    ``rounding`` of a value (|v| < 4) where a query attends to one token."""
    step = make_step([40, 0, 20], [1, 30, 12], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    full = run(step, step.kv_cache.clone(), 1.0, 1.0)
    fp8_cache = step.kv_cache.to(fp8)
    quantized = run(step, fp8_cache, 1.0, 1.0)
    error = (quantized - full).abs()
    assert error.max() < 4 * rounding and error.mean() < mean_error, (error.max(), error.mean())


def test_scales_extend_the_range() -> None:
    """Values of magnitude ~1000 saturate an unscaled E4M3 cache (max 448); with a scale of 16
    they are stored in range (below 4 sigma / 16 * 1000 = 250) and read back within E4M3's precision."""
    step = make_step([0], [20], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    step.value.mul_(1000.0)
    exact = run(step, step.kv_cache.clone(), 1.0, 1.0)
    scaled = run(step, step.kv_cache.to(FP8), 1.0, 16.0)
    unscaled = run(step, step.kv_cache.to(FP8), 1.0, 1.0)
    relative = lambda out: ((out - exact).norm() / exact.norm()).item()  # noqa: E731
    assert relative(scaled) < 0.05 < relative(unscaled)


def test_e5m2_holds_large_values_unscaled() -> None:
    """Values of magnitude ~1000, which saturate an unscaled E4M3 cache, fit E5M2's range
    (+-57344) as they are, read back within its precision: E5M2 runs with scales of 1.0."""
    step = make_step([0], [20], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    step.value.mul_(1000.0)
    exact = run(step, step.kv_cache.clone(), 1.0, 1.0)
    e5m2 = run(step, step.kv_cache.to(E5M2), 1.0, 1.0)
    e4m3 = run(step, step.kv_cache.to(FP8), 1.0, 1.0)
    relative = lambda out: ((out - exact).norm() / exact.norm()).item()  # noqa: E731
    assert relative(e5m2) < 0.1 < relative(e4m3)
