"""compressed-tensors FP8 checkpoints at tensor_parallel_size=2 (two real worker processes
over gloo) give the greedy tokens of one device, logprobs within float32 summation error:
per-channel weights with dynamic per-token activations (and an FP8 KV cache), and per-tensor
weights with static activation scales. A row-parallel layer quantizes each token with its
whole row's scale (the ranks' slices agree on the largest), so every product is the one
device's. The block-fp8 layout and online ``fp8``: ``test_tensor_parallel_fp8_blocks.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar_models.testing import build_tiny_model
from test_quant_fp8 import calibrated_input_scales, compressed_tensors_config, per_channel, per_tensor, write_checkpoint
from tp_compare import assert_same_greedy_run, two_ranks_and_one_device

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2)
EXACT = 1e-4  # the same FP8 products on each rank, summed in another order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tp-fp8") / "llama", **SHAPE)


def test_compressed_tensors_per_channel_with_an_fp8_kv_cache(tiny: Path, tmp_path: Path) -> None:
    quantized, _ = write_checkpoint(tiny, tmp_path, per_channel, compressed_tensors_config("channel", False))
    assert_same_greedy_run(*two_ranks_and_one_device(str(quantized), kv_cache_dtype="fp8"), EXACT)


def test_compressed_tensors_per_tensor_with_static_activation_scales(tiny: Path, tmp_path: Path) -> None:
    # q, k and v each with its own weight scale (kept per row) and input scale (the fused layer takes the largest)
    scales = calibrated_input_scales(tiny)
    quantized, _ = write_checkpoint(tiny, tmp_path, per_tensor, compressed_tensors_config("tensor", True), scales)
    assert_same_greedy_run(*two_ranks_and_one_device(str(quantized)), EXACT)
