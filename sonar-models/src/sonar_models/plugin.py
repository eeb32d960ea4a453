"""Registers sonar-models' architectures and weight formats with Sonar."""

from __future__ import annotations

from typing import Callable

from sonar.hookspecs import hookimpl

ARCHITECTURES = {
    "LlamaForCausalLM": "sonar_models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "sonar_models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "sonar_models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sonar_models.llama:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "sonar_models.llama:Phi3ForCausalLM",
    "GemmaForCausalLM": "sonar_models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "sonar_models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "sonar_models.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "sonar_models.gemma:Gemma3ForConditionalGeneration",
    "Qwen3MoeForCausalLM": "sonar_models.moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "sonar_models.moe:Qwen2MoeForCausalLM",
    "MixtralForCausalLM": "sonar_models.moe:MixtralForCausalLM",
}


@hookimpl
def sonar_register_models(register: Callable[..., None]) -> None:
    for architecture, class_path in ARCHITECTURES.items():
        register(architecture, class_path)


@hookimpl
def sonar_register_weight_formats(register: Callable[..., None]) -> None:
    from sonar_models.formats import DummyFormat, GGUFFormat, SafetensorsFormat

    # order matters: the engine asks each format in turn whether it detects the path
    register("safetensors", SafetensorsFormat())
    register("gguf", GGUFFormat())
    register("dummy", DummyFormat())


@hookimpl
def sonar_register_quantization_methods(register: Callable[..., None]) -> None:
    register("gguf", "sonar_models.formats.gguf_quant:GGUFMethod")
