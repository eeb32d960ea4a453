"""GPTQ and AWQ mixture-of-experts checkpoints: every expert's gate, up and down projection
packed as the format packs any linear layer (written by ``int4_quantizer``), the routers left
floating. They load with each expert held by the format's own linear layers and generate what
transformers generates on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from int4_quantizer import write_int4_checkpoint
from sonar.quantization import LinearExpertsMethod
from sonar_models.testing import build_tiny_model, load_sonar_model
from test_quant_int4 import assert_runs_like_transformers

VARIANTS = {
    "gptq-asym-g32-act-order": dict(fmt="gptq", group_size=32, sym=False, desc_act=True),
    "gptq-sym-per-channel": dict(fmt="gptq", group_size=-1, sym=True),
    "awq-g32": dict(fmt="awq", group_size=32),
}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_int4_experts_run_greedy_equal_to_transformers_on_dequantized_weights(arch: str, variant: str, tmp_path: Path) -> None:
    source = build_tiny_model(arch, tmp_path / "hf", **({"shared_expert_intermediate_size": 64} if arch == "qwen2_moe" else {}))
    quantized, dequantized = write_int4_checkpoint(source, tmp_path, **VARIANTS[variant])
    stored = load_file(str(quantized / "model.safetensors"))
    assert "model.layers.0.mlp.experts.1.down_proj.qweight" in stored and "model.layers.0.mlp.gate.weight" in stored
    assert_runs_like_transformers(quantized, dequantized)


def test_the_gpu_path_dequantizes_every_expert_into_the_fused_weights(tmp_path: Path) -> None:
    """What a GPU does once every expert has arrived (the projections applied to the identity,
    stacked for ``fused_moe``) gives the layer output the held projections give."""
    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    quantized, dequantized = write_int4_checkpoint(source, tmp_path, fmt="gptq", group_size=32, sym=False, desc_act=True)
    model = load_sonar_model(quantized)
    (experts,) = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert isinstance(experts.method, LinearExpertsMethod)
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    topk_ids = torch.tensor([[0, 3], [1, 2], [7, 0], [5, 6], [3, 3], [4, 1]])
    topk_weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    held = experts(x, topk_weights, topk_ids)
    experts.method._dequantize(experts)
    assert experts.linear_experts is None and experts.w13.shape == (8, 2 * experts.intermediate_size, x.shape[1])
    torch.testing.assert_close(experts(x, topk_weights, topk_ids), held, atol=1e-5, rtol=1e-5)
    float_weights = load_file(str(dequantized / "model.safetensors"))
    torch.testing.assert_close(experts.w2[3], float_weights["model.layers.0.mlp.experts.3.down_proj.weight"], atol=1e-6, rtol=0)


def test_a_float_expert_in_a_gptq_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from sonar import LLM

    source = build_tiny_model("qwen3_moe", tmp_path / "hf")
    quantized, _ = write_int4_checkpoint(source, tmp_path, fmt="gptq", group_size=32, sym=True)
    tensors = load_file(str(quantized / "model.safetensors"))
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"model.layers.0.mlp.experts.5.up_proj.{leaf}"]
    tensors["model.layers.0.mlp.experts.5.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(Exception, match="experts.5.up_proj.weight"):
        LLM(str(quantized), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
