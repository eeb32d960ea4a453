"""A single ``.gguf`` file (llama.cpp): config, tokenizer and dequantized weights.

Tensors are dequantized to float32 one at a time at load time (``gguf.quants``), renamed to
Hugging Face names, and for llama-arch files the q/k rows are put back in Hugging Face's rotary
layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sonar_models.formats.gguf_metadata import architecture_of, config_from_gguf, field_value, open_gguf

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
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
IGNORED_TENSORS = {"rope_freqs.weight"}  # folded into the config's rope scaling
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFormat:
    """Reads a llama.cpp ``.gguf`` file (llama, qwen2, qwen3 architectures)."""

    name = "gguf"

    def detect(self, model_path: Path) -> bool:
        """A file whose name ends in ``.gguf``."""
        model_path = Path(model_path)
        return model_path.is_file() and model_path.suffix.lower() == ".gguf"

    def load_hf_config(self, model_path: Path) -> Any:
        """The Hugging Face config built from the file's metadata."""
        return config_from_gguf(open_gguf(model_path))

    def load_tokenizer(self, model_path: Path) -> Any:
        """The tokenizer ``transformers`` builds from the file, with its chat template."""
        from transformers import AutoTokenizer

        model_path = Path(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
        template = field_value(open_gguf(model_path), "tokenizer.chat_template")
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        return tokenizer

    def iter_weights(self, model_path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, dequantized to float32, under its Hugging Face name."""
        reader = open_gguf(model_path)
        _, mapping = architecture_of(reader)
        for tensor in reader.tensors:
            if tensor.name in IGNORED_TENSORS:
                continue
            name = hf_name(tensor.name)
            weight = dequantize(tensor)
            if mapping.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rotary_rows(weight, hf_config.num_attention_heads)
            elif mapping.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rotary_rows(weight, hf_config.num_key_value_heads)
            yield name, weight


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this reader")
    layer, kind, leaf = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[kind]}.{leaf}"


def dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch order (GGUF lists dims fastest-first, so reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:
        values = values.copy()  # F32 tensors come straight from the read-only memory map
    return torch.from_numpy(values)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    Hugging Face rotates the two halves of each head's dims as pairs; llama.cpp interleaves
    them (row ``2i`` and ``2i + 1`` form a pair), so its converter reordered each head's rows.
    Per head this regroups rows ``[pair][2]`` back into ``[2][pair]``.
    """
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    per_head = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
