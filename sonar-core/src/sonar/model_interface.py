"""What the engine expects of a model class and of a weight format.

A model class (registered with ``sonar_register_models``) is a ``torch.nn.Module`` with::

    def __init__(self, hf_config: PretrainedConfig, attention: AttentionFactory) -> None
    def forward(self, input_ids: Tensor [T], positions: Tensor [T], ctx: ForwardContext) -> Tensor [T, hidden]
    def compute_logits(self, hidden_states: Tensor [N, hidden]) -> Tensor [N, vocab] (float32)
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None  # Hugging Face names
    num_layers: int; num_kv_heads: int; head_dim: int  # for sizing the KV cache
    def kv_cache_specs(self) -> list[KVCacheSpec]  # optional: one per layer

Each attention layer holds ``attention(num_heads, num_kv_heads, head_dim, scale, layer_idx,
sliding_window=None, logit_softcap=None)`` and calls it as ``attn(q, k, v, ctx)``;
``sliding_window=W`` lets a token attend only to the last ``W`` positions (itself included),
``logit_softcap=c`` caps each scaled score ``s`` at ``c * tanh(s / c)`` (Gemma 2).

``kv_cache_specs()`` tells the KV-cache manager what each layer reads from the cache
(``FullAttentionSpec``, or ``SlidingWindowSpec(W)`` for a layer built with
``sliding_window=W``, see ``kv_cache_spec_for``); a model without the method is taken as
full attention in every layer.

Quantization: the engine builds the model inside ``sonar.quantization.building_with(method)``
(the constructor's signature stays as above). Each linear layer asks
``sonar.quantization.linear_method_for(prefix)`` for its ``LinearMethod`` while it is built,
lets it ``create_weights`` on the layer, loads checkpoint tensors through its
``load_checkpoint_tensor`` and runs through its ``apply`` (``sonar_models.layers.Linear`` does
all three). A model whose layers never ask is unquantized, and refuses a quantized checkpoint
when its ``load_weights`` meets a tensor it has no place for.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from sonar.attention import AttentionBackend, ForwardContext, reference_attention
from sonar.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

logger = logging.getLogger(__name__)


class PagedAttention(torch.nn.Module):
    """One layer's attention over its slice of the paged KV cache.

    ``k_scale`` / ``v_scale`` dequantize an FP8 cache (``stored = value / scale``); a model sets
    them from its checkpoint with ``set_kv_scales`` (1.0 otherwise; an E5M2 cache always uses
    1.0, see ``settle_kv_cache_scales``; other caches ignore them).
    """

    def __init__(
        self, backend: AttentionBackend | None, layer_idx: int, scale: float, sliding_window: int | None = None, logit_softcap: float | None = None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.has_checkpoint_kv_scales = False

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Use the checkpoint's KV-cache scales for this layer (positive, finite)."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (value > 0.0 and math.isfinite(value)):
                raise ValueError(f"layer {self.layer_idx}: {name}={value} must be a positive finite number")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.has_checkpoint_kv_scales = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        kv_cache = ctx.kv_caches[self.layer_idx]
        connector = ctx.kv_connector
        if connector is not None:  # a KV connector's loads of this layer land first
            connector.wait_for_layer_load(self.layer_idx)
        if self.backend is None:
            out = reference_attention(
                q, k, v, kv_cache, ctx.attn_metadata, self.scale, self.sliding_window, self.k_scale, self.v_scale, self.logit_softcap
            )
        else:
            out = self.backend.forward(q, k, v, kv_cache, ctx.attn_metadata, k_scale=self.k_scale, v_scale=self.v_scale)
        if connector is not None:  # this step's keys and values of the layer are in the cache now
            connector.save_kv_layer(self.layer_idx, kv_cache, ctx.attn_metadata)
        return out


def settle_kv_cache_scales(model: torch.nn.Module, cache_dtype: torch.dtype) -> None:
    """Fix the KV-cache scales of ``model``'s attention layers for a cache of ``cache_dtype``.

    An E4M3 cache keeps the checkpoint's scales, with one warning when some layers have none
    (they use 1.0). An E5M2 cache is unscaled, as vLLM runs it (its range, +-57344, holds keys
    and values as they are): every layer uses 1.0, with one note when the checkpoint's scales go
    unused. Other caches ignore the scales.
    """
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    scaled = [m for m in layers if m.has_checkpoint_kv_scales]
    if cache_dtype == torch.float8_e4m3fn and len(scaled) < len(layers):
        logger.warning(
            "FP8 KV cache: the checkpoint has no k_scale/v_scale for %d of %d attention layers; they use 1.0 "
            "(keys and values beyond +-448 saturate)", len(layers) - len(scaled), len(layers),
        )
    elif cache_dtype == torch.float8_e5m2:
        for layer in layers:
            layer.k_scale = layer.v_scale = 1.0
        if scaled:
            logger.info("FP8 E5M2 KV cache: unscaled; the checkpoint's k_scale/v_scale of %d attention layers are not used", len(scaled))


AttentionFactory = Callable[..., PagedAttention]


def kv_cache_spec_for(sliding_window: int | None) -> KVCacheSpec:
    """The spec of a layer built with ``attention(..., sliding_window=sliding_window)``."""
    return FullAttentionSpec() if sliding_window is None else SlidingWindowSpec(sliding_window)


def make_attention_factory(backend_cls: type[AttentionBackend] | None) -> AttentionFactory:
    """A factory that shares one backend instance per distinct layer shape."""
    backends: dict[tuple, AttentionBackend] = {}

    def factory(
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> PagedAttention:
        if backend_cls is None:
            return PagedAttention(None, layer_idx, scale, sliding_window, logit_softcap)
        shape = (num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        if shape not in backends:
            capped = {} if logit_softcap is None else {"logit_softcap": logit_softcap}  # a backend of before the cap still builds uncapped layers
            backends[shape] = backend_cls(num_heads, num_kv_heads, head_dim, scale, sliding_window, **capped)
        return PagedAttention(backends[shape], layer_idx, scale, sliding_window, logit_softcap)

    return factory


class WeightFormat(Protocol):
    """How a model path becomes a config, a tokenizer and a stream of weights."""

    name: str

    def detect(self, model_path: Path) -> bool:
        """Whether this format reads ``model_path`` (a folder or a file)."""

    def load_hf_config(self, model_path: Path) -> Any:
        """A ``transformers.PretrainedConfig`` for the model."""

    def load_tokenizer(self, model_path: Path) -> Any:
        """A Hugging Face tokenizer (with its chat template where the checkpoint has one)."""

    def iter_weights(self, model_path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors under their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``)."""

    # optional: ``init_weights(model)`` fills a built model's parameters in place on its device
    # instead of streaming ``iter_weights`` (the engine calls it where a format defines it)
