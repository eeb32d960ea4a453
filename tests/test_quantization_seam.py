"""A third-party quantization format plugs in through ``sonar_register_quantization_methods``:
a per-output-channel int8 checkpoint runs through ``LLM`` greedy-equal to transformers on the
dequantized weights; unknown methods and platforms that cannot run one are refused at load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import HFOracle, random_prompts
from sonar import LLM, SamplingParams, ops, registry
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.quantization import LinearMethod, QuantizationMethod, UnquantizedLinearMethod
from sonar_models.testing import build_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8LinearMethod(LinearMethod):
    """``weight`` int8 ``[out, in]`` and ``weight_scale`` ``[out]``: ``W = weight * scale``."""

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        layer.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
        return ops.linear(x, weight, layer.bias)


class Int8Method(QuantizationMethod):
    """Every decoder projection int8 per output channel; ``lm_head`` stays in floating point."""

    name = "test-int8"
    platforms = ("cpu", "cuda")

    def __init__(self, bits: int = 8) -> None:
        self.bits = bits

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Int8Method:
        return cls(bits=int(quant_config.get("bits", 8)))

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        assert self.bits == 8
        return UnquantizedLinearMethod() if layer_prefix == "lm_head" else Int8LinearMethod()


class CudaOnlyInt8Method(Int8Method):
    name = "test-int8-cuda"
    platforms = ("cuda", "rocm")


class _Plugin:
    @hookimpl
    def sonar_register_quantization_methods(self, register) -> None:
        register("test-int8", Int8Method)
        register("test-int8-cuda", CudaOnlyInt8Method)


@pytest.fixture
def int8_plugin() -> Iterator[None]:
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="test-int8-quantization")
    registry.clear_caches()
    try:
        yield
    finally:
        manager.unregister(name="test-int8-quantization")
        registry.clear_caches()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@pytest.fixture(scope="module")
def int8_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(int8 folder for Sonar, dequantized float folder for transformers)`` of one tiny Llama."""
    root = tmp_path_factory.mktemp("int8")
    quantized = build_tiny_model("llama", root / "int8")
    dequantized = root / "dequantized"
    shutil.copytree(quantized, dequantized)
    tensors = load_file(str(quantized / "model.safetensors"))
    int8_tensors, float_tensors = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            q, scale = quantize_per_channel(tensor.float())
            int8_tensors[name], int8_tensors[f"{name}_scale"] = q, scale
            float_tensors[name] = (q.float() * scale[:, None]).to(tensor.dtype)
        else:
            int8_tensors[name] = float_tensors[name] = tensor
    save_file(int8_tensors, str(quantized / "model.safetensors"))
    save_file(float_tensors, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "test-int8", "bits": 8}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def test_int8_checkpoint_runs_greedy_equal_to_transformers_on_dequantized_weights(int8_plugin, int8_checkpoints) -> None:
    quantized, dequantized = int8_checkpoints
    assert load_file(str(quantized / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    llm = LLM(str(quantized), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.config.quantization == "test-int8"
    prompts = random_prompts(4, seed=14, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle(dequantized)
    for prompt, output in zip(prompts, outputs):
        expected, _ = oracle.greedy(prompt, 16)
        assert output.outputs[0].token_ids == expected


def test_a_platform_that_cannot_run_the_method_is_refused_naming_those_that_can(int8_plugin, int8_checkpoints) -> None:
    quantized, _ = int8_checkpoints
    with pytest.raises(ValueError, match=r"'test-int8-cuda' does not run on the 'cpu' platform; platforms that run it: cuda, rocm"):
        LLM(str(quantized), quantization="test-int8-cuda")


def test_an_unregistered_method_is_refused_listing_the_registered_ones(int8_checkpoints) -> None:
    quantized, _ = int8_checkpoints
    with pytest.raises(ValueError, match=r"quant_method 'test-int8' is not a registered quantization method; registered: .*unquantized"):
        LLM(str(quantized))
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes-nf5' is not a registered quantization method; registered: .*unquantized"):
        LLM(str(quantized), quantization="bitsandbytes-nf5")


def test_the_command_line_forces_a_method_with_quantization(int8_plugin, int8_checkpoints) -> None:
    import argparse

    from sonar.cli.engine_args import add_engine_arguments, engine_args_from
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform

    quantized, _ = int8_checkpoints
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config, _ = resolve_engine_config(engine_args_from(parser.parse_args([str(quantized)])), current_platform())
    assert config.quantization == "test-int8"
    with pytest.raises(ValueError, match="platforms that run it: cuda, rocm"):
        resolve_engine_config(engine_args_from(parser.parse_args([str(quantized), "-q", "test-int8-cuda"])), current_platform())
