"""GGUF metadata -> a ``transformers`` config.

llama.cpp stores hyperparameters under ``{arch}.*`` keys (``llama.block_count``, ...) and the
vocabulary under ``tokenizer.ggml.*``. This module reads them into the config class Hugging Face
uses for the same architecture.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sonar_models.formats.gguf_reader import GGUFHeader

logger = logging.getLogger(__name__)


#: llama.cpp's per-layer tensor names -> Hugging Face's module names, Llama's layer
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Gemma 2 and 3: a norm before and after each of attention and the MLP
GEMMA2_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Qwen2-MoE and Qwen3-MoE: a router, every expert of a projection in one ``[E, rows, cols]``
#: tensor (split per expert at load), and Qwen2-MoE's shared expert with its gate
MOE_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: Phi-3: q/k/v in one tensor, and ``ffn_up`` holding the gate's rows then the up rows
PHI3_LAYER_NAMES = {**LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


@dataclass(slots=True, frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps to Hugging Face: the model and config classes, the
    per-layer tensor names, whether llama.cpp's converter interleaved the rotary halves of the
    q/k rows (``permuted_qk``) and what it added to every norm weight (``norm_shift``: Gemma's
    norms multiply by ``1 + w``, and llama.cpp stores ``1 + w``)."""

    hf_architecture: str  # "LlamaForCausalLM"
    config_class: str  # "LlamaConfig"
    permuted_qk: bool = False
    layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)
    norm_shift: float = 0.0


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "LlamaConfig", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", "Qwen2MoeConfig", layer_names=MOE_LAYER_NAMES),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", layer_names=MOE_LAYER_NAMES),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "Phi3Config", layer_names=PHI3_LAYER_NAMES),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "Gemma2Config", layer_names=GEMMA2_LAYER_NAMES, norm_shift=1.0),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "Gemma3TextConfig", layer_names=GEMMA2_LAYER_NAMES, norm_shift=1.0),
}
#: what llama.cpp assumes where a file does not say: the sliding-window layer pattern (every
#: ``n``-th layer global, the others sliding) and the sliding layers' rotary base
SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6}
GEMMA3_SLIDING_ROPE_BASE = 10000.0
#: llama.cpp scales Gemma 2 and 3 queries by ``1 / sqrt(head_dim)``, except for the 27B models
#: (told apart by their layer count), which use ``1 / sqrt(hidden / heads)``
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
#: whether llama.cpp renormalises the chosen experts' probabilities (it does not read a flag)
MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
#: Phi-3's LongRoPE factors, stored as tensors
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


# Llama 3.x stores its rope scaling only as per-frequency factors (tensor rope_freqs.weight);
# these are the shape parameters every Llama 3.x release uses, checked against the tensor.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int) -> GGUFHeader:
    from sonar_models.formats.gguf_reader import read_gguf

    return read_gguf(path)


def open_gguf(path: Path) -> GGUFHeader:
    """``path``'s parsed header (``gguf_reader``), kept for the next caller while the file is
    unchanged."""
    path = Path(path)
    return _open_cached(str(path.resolve()), path.stat().st_mtime_ns)


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` (str, number or list), or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture_of(reader: Any) -> tuple[str, GGUFArchitecture]:
    """``(llama.cpp name, mapping)`` of the file's ``general.architecture``."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported yet (supported: {sorted(GGUF_ARCHITECTURES)})"
        )
    return arch, GGUF_ARCHITECTURES[arch]


def config_from_gguf(reader: Any) -> Any:
    """Build the Hugging Face config of the model in a GGUF file."""
    import transformers

    arch, mapping = architecture_of(reader)
    meta = _Metadata(reader, arch)
    tensor_names = {tensor.name for tensor in reader.tensors}
    num_heads = int(meta("attention.head_count"))
    hidden_size = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = tokens.count if tokens is not None else int(meta("vocab_size"))
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
    )
    rope_theta = float(meta("rope.freq_base", 10000.0))
    if arch == "phi3":
        extra = _phi3_fields(reader, meta, tensor_names, head_dim, rope_theta)
    elif arch in ("gemma2", "gemma3"):
        extra = _gemma_fields(meta, arch, common, rope_theta, _rope_scaling(meta, tensor_names, head_dim, rope_theta))
    else:
        extra = dict(rope_theta=rope_theta, rope_scaling=_rope_scaling(meta, tensor_names, head_dim, rope_theta))
    if arch in MOE_NORM_TOPK:
        extra.update(_moe_fields(meta, arch))
    config = getattr(transformers, mapping.config_class)(**common, **extra)
    config.architectures = [mapping.hf_architecture]
    return config


class _Metadata:
    """``meta(key)``: the file's ``{arch}.{key}``; its ``default`` where absent, and an error
    naming the key where there is none."""

    def __init__(self, reader: Any, arch: str) -> None:
        self.reader, self.arch = reader, arch

    def __call__(self, key: str, default: Any = None) -> Any:
        value = field_value(self.reader, f"{self.arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata {self.arch}.{key}")
        return value

    def optional(self, key: str) -> Any:
        return field_value(self.reader, f"{self.arch}.{key}")


def _moe_fields(meta: _Metadata, arch: str) -> dict[str, Any]:
    """The experts of every layer (llama.cpp has no dense layers in these architectures)."""
    fields: dict[str, Any] = dict(
        num_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        norm_topk_prob=MOE_NORM_TOPK[arch],
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(meta("expert_shared_feed_forward_length"))
    return fields


def _gemma_fields(meta: _Metadata, arch: str, common: dict[str, Any], rope_theta: float, scaling: dict | None) -> dict[str, Any]:
    """Gemma 2 and 3: the score scale llama.cpp derives, the sliding window and which layers
    use it, the tanh caps, and (Gemma 3) the sliding layers' own rotary base."""
    num_layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    is_27b = num_layers == GEMMA_27B_LAYERS[arch]
    pattern = int(meta("attention.sliding_window_pattern", SLIDING_PATTERNS[arch]))
    fields: dict[str, Any] = dict(
        query_pre_attn_scalar=common["hidden_size"] // heads if is_27b else common["head_dim"],
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(num_layers)],
        attn_logit_softcapping=meta.optional("attn_logit_softcapping"),
        final_logit_softcapping=meta.optional("final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "gemma2":
        return {**fields, "rope_theta": rope_theta, "rope_scaling": scaling}
    sliding_base = float(meta("rope.freq_base_swa", GEMMA3_SLIDING_ROPE_BASE))
    full = {"rope_type": "default", **(scaling or {}), "rope_theta": rope_theta}
    return {**fields, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": sliding_base}, "full_attention": full}}


def _phi3_fields(reader: Any, meta: _Metadata, tensor_names: set[str], head_dim: int, rope_theta: float) -> dict[str, Any]:
    """Phi-3: a partial rotary dimension, LongRoPE from its factor tensors (where the file has
    them) and the pretraining length they switch at, and a sliding window where set."""
    rotary_dim = int(meta("rope.dimension_count", head_dim))
    context = int(meta("context_length"))
    fields: dict[str, Any] = dict(
        rope_theta=rope_theta,
        partial_rotary_factor=rotary_dim / head_dim,
        original_max_position_embeddings=int(meta("rope.scaling.original_context_length", context)),
        sliding_window=meta.optional("attention.sliding_window") or None,
    )
    present = [name in tensor_names for name in PHI3_ROPE_FACTORS]
    if any(present):
        if not all(present):
            raise ValueError(f"GGUF file has one of {PHI3_ROPE_FACTORS} without the other")
        long, short = (_float_tensor(reader, name).tolist() for name in PHI3_ROPE_FACTORS)
        if len(long) != rotary_dim // 2 or len(short) != rotary_dim // 2:
            raise ValueError(f"GGUF LongRoPE factors have {len(long)} and {len(short)} entries; the rotary dimension {rotary_dim} needs {rotary_dim // 2}")
        scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        attention = meta.optional("rope.scaling.attn_factor")
        if attention is not None:
            scaling["attention_factor"] = float(attention)
        fields["rope_scaling"] = scaling
    return fields


def _float_tensor(reader: Any, name: str) -> torch.Tensor:
    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(tensor.data.astype("float32").copy())


def _rope_scaling(meta: _Metadata, tensor_names: set[str], head_dim: int, theta: float) -> dict | None:
    rotary_dim = int(meta("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise NotImplementedError(f"partial rotary (rope.dimension_count={rotary_dim}, head_dim={head_dim}) in a {meta.arch} GGUF")
    if "rope_freqs.weight" in tensor_names:
        return _llama3_scaling_from_factors(meta.reader, head_dim, theta)
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    raise NotImplementedError(f"GGUF rope scaling type {scaling_type!r} is not supported yet (none, linear)")


def _llama3_scaling_from_factors(reader: Any, head_dim: int, theta: float) -> dict:
    from sonar_models.rope import RopeSpec, inverse_frequencies

    factors = _float_tensor(reader, "rope_freqs.weight")  # [head_dim // 2]
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE_DEFAULTS}
    base = inverse_frequencies(RopeSpec(head_dim, head_dim, theta))
    scaled = inverse_frequencies(RopeSpec(head_dim, head_dim, theta, "llama3", scaling))
    if not torch.allclose(base / scaled, factors, rtol=1e-3):
        raise NotImplementedError("rope_freqs.weight does not match Llama 3 rope scaling; this GGUF is not supported")
    return scaling
