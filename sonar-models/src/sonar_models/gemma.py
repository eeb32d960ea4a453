"""Gemma, Gemma 2 and Gemma 3 (text): Llama's decoder with Gemma's conventions.

- Every RMSNorm scales by ``1 + w`` (the checkpoint stores the offset ``w``); the 1 is added
  to each norm weight at load, so the platform's RMSNorm kernels run it unchanged.
- The embedding's output is multiplied by ``sqrt(hidden_size)`` rounded to the model dtype.
- The MLP is GeGLU (``gelu_pytorch_tanh``), its activation from the config.
- Gemma 3 adds a norm after the attention and around the MLP (four per layer), per-head q/k
  norms, a ``query_pre_attn_scalar ** -0.5`` score scale, sliding-window layers that rotate
  with their own base (``rope_parameters["sliding_attention"]``) beside global layers
  (``rope_parameters["full_attention"]``, with its scaling), and an optional tanh cap on the
  logits (``final_logit_softcapping``).
- Gemma 2 has Gemma 3's four norms, scalar and alternating sliding-window layers, without q/k
  norms and with one rotary set, and caps attention scores with a tanh
  (``attn_logit_softcapping``, applied by the attention backends) as well as the logits.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from sonar.attention import ForwardContext
from sonar_models.layers import RMSNorm
from sonar_models.llama import DecoderAttention, LlamaForCausalLM

NORM_LEAVES = ("layernorm.weight", "norm.weight")  # input_layernorm, q_norm, model.norm, ...


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma: Llama's layer with ``1 + w`` norms, a scaled embedding and a GeGLU MLP."""

    qkv_bias = False
    o_bias = False

    def __init__(self, hf_config: Any, attention: Any) -> None:
        super().__init__(hf_config, attention)
        self.model.embed_scale = hf_config.hidden_size**0.5

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The norms' ``1 + w`` (in float32, before the copy rounds it to the model dtype)."""
        for name, tensor in super().checkpoint_tensors(weights):
            if name.endswith(NORM_LEAVES) and tensor.is_floating_point():
                tensor = tensor.float() + 1.0
            yield name, tensor


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's layer: ``h = x + post_attn_norm(attn(in_norm(x)))``, then
    ``h + post_ffw_norm(mlp(pre_ffw_norm(h)))``, the residual adds fused into the next norm."""

    def __init__(self, attn: DecoderAttention, mlp: nn.Module, config: Any) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Any, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in and out; the layer's output is ``hidden + residual``."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, ctx))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): Gemma's conventions with four norms a layer, q/k norms, local and
    global layers that rotate differently, and the query pre-attention scalar."""

    qk_norm = True

    def build_layer(self, config: Any, attn: DecoderAttention, mlp: nn.Module) -> nn.Module:
        return Gemma3DecoderLayer(attn, mlp, config)

    def attention_scale(self, config: Any) -> float | None:
        return float(config.query_pre_attn_scalar) ** -0.5

    def layer_rope_types(self, config: Any) -> list[str] | None:
        return list(config.layer_types)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: Gemma's conventions with four norms a layer, the query pre-attention scalar,
    alternating sliding-window and global layers (one rotary set) and tanh caps on the
    attention scores and the logits."""

    def build_layer(self, config: Any, attn: DecoderAttention, mlp: nn.Module) -> nn.Module:
        return Gemma3DecoderLayer(attn, mlp, config)

    def attention_scale(self, config: Any) -> float | None:
        return float(config.query_pre_attn_scalar) ** -0.5

    def layer_windows(self, config: Any) -> list[int | None]:
        """``layer_types`` where the config has them; a config from before them (transformers
        4.x) alternates as Gemma 2 does: even layers slide, odd ones see everything."""
        if getattr(config, "layer_types", None) is not None or not getattr(config, "sliding_window", None):
            return super().layer_windows(config)
        return [int(config.sliding_window) if i % 2 == 0 else None for i in range(config.num_hidden_layers)]


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's image-and-text checkpoints (4B and up) served as text models: the language
    model's weights, under either naming (``language_model.model.*``, as published, or
    ``model.language_model.*``); the vision tower and its projector are not loaded, so a
    request with images is refused as for any text model."""

    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    @staticmethod
    def language_model_config(hf_config: Any) -> Any:
        """The text config the model is built from, carrying the checkpoint's architecture,
        quantization and dtype."""
        text = hf_config.get_text_config()
        text.architectures = list(getattr(hf_config, "architectures", None) or ["Gemma3ForConditionalGeneration"])
        for name in ("quantization_config", "dtype", "torch_dtype"):
            value = getattr(hf_config, name, None)
            if value is not None and getattr(text, name, None) is None:
                setattr(text, name, value)
        return text

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        def language_model(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                if name.startswith(self.VISION_PREFIXES):
                    continue
                if name.startswith("language_model."):
                    name = name.removeprefix("language_model.")  # language_model.model.x, language_model.lm_head.x
                elif name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                yield name, tensor

        return super().checkpoint_tensors(language_model(weights))

