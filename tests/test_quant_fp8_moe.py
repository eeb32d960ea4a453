"""FP8 mixture-of-experts checkpoints (compressed-tensors per tensor and per channel, the HF
``fp8`` layout with 128x128 block scales): every expert's projections stored in FP8 with their
scales, as llm-compressor and Qwen's FP8 releases store them, and the routers left floating.
They load with the experts kept in FP8 (W8A16: the experts' activations are not quantized)
and generate what transformers generates on the dequantized weights, with the dense
projections' activations quantized as the scheme says."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar import LLM
from sonar.quantization.fp8 import FP8_DTYPE, Fp8ExpertsMethod, quantize_per_row
from sonar_models.testing import build_tiny_model, load_sonar_model
from test_quant_fp8 import (
    assert_runs_like_transformers, calibrated_input_scales, compressed_tensors_config, per_block, per_channel, per_tensor,
    write_checkpoint,
)

#: 128-wide so that 128x128 blocks tile every expert projection
BLOCK_SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_compressed_tensors_per_channel_experts_dynamic_activations(arch: str, tmp_path: Path) -> None:
    source = build_tiny_model(arch, tmp_path / "hf")
    quantized, dequantized = write_checkpoint(source, tmp_path, per_channel, compressed_tensors_config("channel", False))
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == FP8_DTYPE
    assert stored["model.layers.0.mlp.gate.weight"].dtype != FP8_DTYPE  # the router stays floating
    assert_runs_like_transformers(quantized, dequantized, "token")


def test_compressed_tensors_per_tensor_experts_with_static_input_scales(tmp_path: Path) -> None:
    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    scales = defaultdict(lambda: 0.05, calibrated_input_scales(source))  # the experts' own are read and not used (W8A16)
    quantized, dequantized = write_checkpoint(source, tmp_path, per_tensor, compressed_tensors_config("tensor", True), scales)
    assert "model.layers.0.mlp.experts.0.gate_proj.input_scale" in load_file(str(quantized / "model.safetensors"))
    assert_runs_like_transformers(quantized, dequantized, "static", scales)


def test_hf_fp8_block_scaled_experts(tmp_path: Path) -> None:
    source = build_tiny_model("qwen3_moe", tmp_path / "hf", **BLOCK_SHAPE)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quantized, dequantized = write_checkpoint(source, tmp_path, per_block, config)
    assert "model.layers.0.mlp.experts.7.up_proj.weight_scale_inv" in load_file(str(quantized / "model.safetensors"))
    assert_runs_like_transformers(quantized, dequantized, "block")


def test_online_fp8_quantizes_a_float_moe_checkpoint_s_experts_at_load(tmp_path: Path) -> None:
    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    dequantized = tmp_path / "dequantized"
    shutil.copytree(source, dequantized)
    tensors = load_file(str(source / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("_proj.weight",)):  # attention, the dense layer and every expert; not the router
            q, scale = quantize_per_row(tensor.float())
            tensors[name] = q.float() * scale[:, None]
    save_file(tensors, str(dequantized / "model.safetensors"))
    assert_runs_like_transformers(source, dequantized, "token", quantization="fp8")
    model = load_sonar_model(source, quantization="fp8")
    (experts,) = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert all(w.dtype == FP8_DTYPE for entry in experts.fp8_experts for w, _ in entry)


def test_experts_stay_fp8_on_the_cpu_and_the_gpu_path_dequantizes_them_alike(tmp_path: Path) -> None:
    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    quantized, _ = write_checkpoint(source, tmp_path, per_channel, compressed_tensors_config("channel", False))
    model = load_sonar_model(quantized)
    (experts,) = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]  # layer 1 is dense (mlp_only_layers)
    assert isinstance(experts.method, Fp8ExpertsMethod)
    assert all(w.dtype == FP8_DTYPE for entry in experts.fp8_experts for w, _ in entry)
    x = torch.randn(6, experts.fp8_sizes[0], generator=torch.Generator().manual_seed(0))
    topk_ids = torch.tensor([[0, 3], [1, 2], [7, 0], [5, 6], [3, 3], [4, 1]])
    topk_weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    on_the_cpu = experts(x, topk_weights, topk_ids)
    experts.method._dequantize(experts)  # what a platform without an FP8 experts kernel does once every expert has arrived
    assert experts.fp8_experts is None and experts.w13.dtype == torch.float32
    torch.testing.assert_close(experts(x, topk_weights, topk_ids), on_the_cpu, atol=1e-5, rtol=1e-5)


def test_a_float_expert_in_an_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    quantized, _ = write_checkpoint(source, tmp_path, per_channel, compressed_tensors_config("channel", False))
    tensors = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(Exception, match="experts.2.up_proj.weight"):
        LLM(str(quantized), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)


def test_expert_parallel_ranks_hold_whole_fp8_experts(tmp_path: Path) -> None:
    """At EP=2 each rank loads and runs its half of the FP8 experts, giving what one device
    gives; splitting every expert's intermediate size (TP without EP) is refused by name."""
    from sonar import SamplingParams

    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    quantized, _ = write_checkpoint(source, tmp_path, per_channel, compressed_tensors_config("channel", False))
    engine = dict(dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3, 4, 5, 6, 7], [5, 900, 17, 3, 44, 8, 2, 19, 6, 33, 71])]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    single = LLM(str(quantized), **engine).generate(prompts, params)
    llm = LLM(str(quantized), tensor_parallel_size=2, enable_expert_parallel=True, **engine)
    try:
        split = llm.generate(prompts, params)
    finally:
        llm.llm_engine.shutdown()
    for one, two in zip(single, split, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            for token_id, logprob in a.items():
                assert b[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)
    with pytest.raises(Exception, match="enable_expert_parallel"):
        LLM(str(quantized), tensor_parallel_size=2, **engine)
