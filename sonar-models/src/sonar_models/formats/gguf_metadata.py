"""GGUF metadata -> a ``transformers`` config.

llama.cpp stores hyperparameters under ``{arch}.*`` keys (``llama.block_count``, ...) and the
vocabulary under ``tokenizer.ggml.*``. This module reads them into the config class Hugging Face
uses for the same architecture.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps to Hugging Face."""

    hf_architecture: str  # "LlamaForCausalLM"
    config_class: str  # "LlamaConfig"
    permuted_qk: bool  # llama.cpp interleaved the rotary halves of q/k rows at conversion


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "LlamaConfig", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "Qwen2Config", permuted_qk=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "Qwen3Config", permuted_qk=False),
}

# Llama 3.x stores its rope scaling only as per-frequency factors (tensor rope_freqs.weight);
# these are the shape parameters every Llama 3.x release uses, checked against the tensor.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``; parsing the header takes seconds, so it is cached."""
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

    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata {arch}.{key}")
        return value

    tensor_names = {tensor.name for tensor in reader.tensors}
    num_heads = int(meta("attention.head_count"))
    hidden_size = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # len(.data): one entry per token, not decoded
    vocab_size = len(tokens.data) if tokens is not None else int(meta("vocab_size"))
    rope_theta = float(meta("rope.freq_base", 10000.0))
    config_class = getattr(transformers, mapping.config_class)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta("context_length")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, tensor_names, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
    )
    config.architectures = [mapping.hf_architecture]
    return config


def _rope_scaling(reader: Any, arch: str, tensor_names: set[str], head_dim: int, theta: float) -> dict | None:
    rotary_dim = int(field_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise NotImplementedError(f"partial rotary (rope.dimension_count={rotary_dim}, head_dim={head_dim})")
    if "rope_freqs.weight" in tensor_names:
        return _llama3_scaling_from_factors(reader, head_dim, theta)
    scaling_type = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    raise NotImplementedError(f"GGUF rope scaling type {scaling_type!r} is not supported yet (none, linear)")


def _llama3_scaling_from_factors(reader: Any, head_dim: int, theta: float) -> dict:
    from sonar_models.rope import RopeSpec, inverse_frequencies

    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = torch.from_numpy(tensor.data.astype("float32").copy())  # [head_dim // 2]
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE_DEFAULTS}
    base = inverse_frequencies(RopeSpec(head_dim, head_dim, theta))
    scaled = inverse_frequencies(RopeSpec(head_dim, head_dim, theta, "llama3", scaling))
    if not torch.allclose(base / scaled, factors, rtol=1e-3):
        raise NotImplementedError("rope_freqs.weight does not match Llama 3 rope scaling; this GGUF is not supported")
    return scaling
