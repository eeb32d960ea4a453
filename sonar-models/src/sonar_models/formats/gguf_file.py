"""A single ``.gguf`` file (llama.cpp): config, tokenizer and weights.

The config declares ``quantization_config = {"quant_method": "gguf"}``, so by default the
linear layers run the file's quantized blocks natively (``gguf_quant``) and receive them as
``GGUFBlocks``; run unquantized (``quantization="unquantized"``) every tensor is dequantized to
float32 one at a time at load (``gguf.quants``). Tensors are renamed to Hugging Face names;
for llama-arch files the q/k rows are put back in Hugging Face's rotary layout, Gemma's norms
lose the 1 llama.cpp added to them, and Phi-3's fused q/k/v and gate/up tensors are split
into their parts (as whole rows of blocks, still quantized). A mixture-of-experts layer's
experts come as one tensor per projection; they are dequantized at load and split per expert
(the experts' fused kernel takes floating weights), while attention and the shared expert stay
quantized.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sonar.quantization import quant_config_of
from sonar_models.formats.gguf_blocks import BLOCK_SIZES, GGUFBlocks
from sonar_models.formats.gguf_metadata import (
    LLAMA_LAYER_NAMES, PHI3_ROPE_FACTORS, GGUFArchitecture, architecture_of, config_from_gguf, field_value, open_gguf,
)
from sonar_models.formats.gguf_quant import TIED_HEAD_PARAM
from sonar_models.formats.gguf_tokenizer import load_gguf_tokenizer

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
IGNORED_TENSORS = {"rope_freqs.weight", *PHI3_ROPE_FACTORS}  # folded into the config's rope scaling
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj", "lm_head")
EMBEDDING = "model.embed_tokens.weight"
EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.weight")
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFormat:
    """Reads a llama.cpp ``.gguf`` file (llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3 architectures)."""

    name = "gguf"

    def detect(self, model_path: Path) -> bool:
        """A file whose name ends in ``.gguf``."""
        model_path = Path(model_path)
        return model_path.is_file() and model_path.suffix.lower() == ".gguf"

    def load_hf_config(self, model_path: Path) -> Any:
        """The Hugging Face config built from the file's metadata, declaring the ``gguf``
        quantization method (``tied_lm_head``: the head reads the embedding's table)."""
        config = config_from_gguf(open_gguf(model_path))
        config.quantization_config = {"quant_method": "gguf", "tied_lm_head": bool(config.tie_word_embeddings)}
        return config

    def load_tokenizer(self, model_path: Path) -> Any:
        """The tokenizer ``transformers`` builds from the file (converted once, then read from
        the cache: ``gguf_tokenizer``), with its chat template."""
        model_path = Path(model_path)
        tokenizer = load_gguf_tokenizer(model_path)
        template = field_value(open_gguf(model_path), "tokenizer.chat_template")
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        return tokenizer

    def iter_weights(self, model_path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """Every tensor under its Hugging Face name: dequantized to float32, except, where
        ``hf_config`` declares the ``gguf`` method, a linear layer's quantized weight, which
        comes as its ``GGUFBlocks`` (and a tied head's table once more, as ``lm_head.tied_weight``)."""
        reader = open_gguf(model_path)
        _, mapping = architecture_of(reader)
        native = (quant_config_of(hf_config) or {}).get("quant_method") == "gguf"
        for tensor in reader.tensors:
            if tensor.name in IGNORED_TENSORS:
                continue
            name = hf_name(tensor.name, mapping)
            quantized = int(tensor.tensor_type) in BLOCK_SIZES
            if native and name == EMBEDDING and hf_config.tie_word_embeddings:
                yield f"lm_head.{TIED_HEAD_PARAM}", raw_blocks(tensor) if quantized else dequantize(tensor)
            if EXPERTS.fullmatch(name):
                yield from split_experts(name, expert_blocks(tensor) if native and quantized else dequantize(tensor))
                continue
            is_linear = name.rpartition(".")[0].rpartition(".")[2] in LINEAR_MODULES
            weight = raw_blocks(tensor) if native and quantized and is_linear and name.endswith(".weight") else dequantize(tensor)
            if name.endswith("shared_expert_gate.weight") and weight.dim() == 1:
                weight = weight.reshape(1, -1)  # llama.cpp keeps the shared expert's gate as a vector
            if mapping.norm_shift and name.endswith("norm.weight"):
                weight = weight - mapping.norm_shift
            for part_name, part in split_fused(name, weight, hf_config):
                if mapping.permuted_qk and part_name.endswith(("q_proj.weight", "q_proj.bias")):
                    part = unpermute_rotary_rows(part, hf_config.num_attention_heads)
                elif mapping.permuted_qk and part_name.endswith(("k_proj.weight", "k_proj.bias")):
                    part = unpermute_rotary_rows(part, hf_config.num_key_value_heads)
                yield part_name, part


def split_experts(name: str, weight: torch.Tensor | list[GGUFBlocks]) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """A projection of every expert (``[E, rows, cols]``, or each expert's blocks) as one
    tensor per expert, under the per-expert names the mixture-of-experts models read."""
    experts, _, rest = name.partition(".experts.")
    for expert in range(len(weight)):
        yield f"{experts}.experts.{expert}.{rest}", weight[expert]


def expert_blocks(tensor: Any) -> list[GGUFBlocks]:
    """A quantized ``[E, rows, cols]`` GGUF tensor as each expert's blocks."""
    cols, rows, num_experts = (int(dim) for dim in tensor.shape.tolist())
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(num_experts, rows, -1))
    return [GGUFBlocks(int(tensor.tensor_type), rows, cols, data[expert]) for expert in range(num_experts)]


def split_fused(name: str, weight: torch.Tensor | GGUFBlocks, hf_config: Any) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """A fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) as its parts under Llama's names,
    each its run of whole rows; any other tensor as it is."""
    module, _, leaf = name.rpartition(".")
    owner, _, fused = module.rpartition(".")
    if fused == "qkv_proj":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        sizes = {"q_proj": hf_config.num_attention_heads * head_dim, "k_proj": hf_config.num_key_value_heads * head_dim}
        sizes["v_proj"] = sizes["k_proj"]
    elif fused == "gate_up_proj":
        sizes = {"gate_proj": hf_config.intermediate_size, "up_proj": hf_config.intermediate_size}
    else:
        yield name, weight
        return
    if weight.shape[0] != sum(sizes.values()):
        raise ValueError(f"GGUF tensor for {name!r} has {weight.shape[0]} rows; the file's metadata gives {sum(sizes.values())}")
    start = 0
    for part, rows in sizes.items():
        piece = weight.select_rows(slice(start, start + rows)) if isinstance(weight, GGUFBlocks) else weight[start : start + rows]
        yield f"{owner}.{part}.{leaf}", piece
        start += rows


def hf_name(gguf_name: str, mapping: GGUFArchitecture | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (the layer names
    of ``mapping``'s architecture; Llama's by default)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = mapping.layer_names if mapping is not None else LLAMA_LAYER_NAMES
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this reader")
    layer, kind, leaf = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{leaf}"


def dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch order (GGUF lists dims fastest-first, so reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:
        values = values.copy()  # F32 tensors come straight from the read-only memory map
    return torch.from_numpy(values)


def raw_blocks(tensor: Any) -> GGUFBlocks:
    """A quantized GGUF matrix as its blocks, one row of blocks per output row."""
    cols, rows = (int(dim) for dim in tensor.shape.tolist())
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
    return GGUFBlocks(int(tensor.tensor_type), rows, cols, data)


def unpermute_rotary_rows(weight: torch.Tensor | GGUFBlocks, num_heads: int) -> torch.Tensor | GGUFBlocks:
    """Undo llama.cpp's q/k row order.

    Hugging Face rotates the two halves of each head's dims as pairs; llama.cpp interleaves
    them (row ``2i`` and ``2i + 1`` form a pair), so its converter reordered each head's rows.
    Per head this regroups rows ``[pair][2]`` back into ``[2][pair]``.
    """
    if isinstance(weight, GGUFBlocks):
        order = unpermute_rotary_rows(torch.arange(weight.rows), num_heads)
        return weight.select_rows(order)
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    per_head = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
