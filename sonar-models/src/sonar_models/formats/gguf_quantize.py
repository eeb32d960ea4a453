"""A small GGUF quantizer of Sonar's own: float matrices into llama.cpp's block formats, and a
Hugging Face folder into a ``.gguf`` file (for tests; no llama.cpp needed).

A Hugging Face folder of any architecture the reader maps is written the way llama.cpp's
converter writes it (``write_gguf``).

Q4_0, Q4_1 and Q8_0 use ``gguf.quants.quantize``; the K-quants, which it lacks, are encoded
here with plain per-block min/max scales (llama.cpp searches its scales; any valid encoding
decodes the same way).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sonar_models.formats.gguf_blocks import (
    BLOCK_SIZES, IQ4_NL, IQ4_VALUES, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
)

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    # 8 six-bit scales and mins -> 12 bytes (llama.cpp's get_scale_min_k4, inverted)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=-1)


def _q45_k(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    # x [n, 8, 32] -> codes, d, dmin, sc, m with w = d * sc * code - dmin * m
    low = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - low) / levels
    d = np.maximum(scale.max(-1, keepdims=True), 1e-12) / 63
    dmin = np.maximum(-low.min(-1, keepdims=True), 1e-12) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 63)
    m = np.clip(np.round(-low / dmin), 0, 63)
    codes = np.clip(np.round((x + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, levels).astype(np.uint8)
    return codes, d, dmin, sc, m


def _nibble_pack(codes: np.ndarray) -> np.ndarray:
    # [n, 256] codes 0..15 -> [n, 128]: per 64 values, 32 bytes, low nibbles first
    chunks = codes.reshape(-1, 4, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)


def _two_bit_pack(codes: np.ndarray) -> np.ndarray:
    # [n, 256] codes 0..3 -> [n, 64]: byte l of half h holds value 128 h + 32 j + l at bits 2j
    halves = codes.reshape(-1, 2, 4, 32)
    return sum(halves[:, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(-1, 64)


def quantize_k(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """``x [rows, cols]`` (cols a multiple of 256) as Q2_K, Q3_K, Q4_K, Q5_K or Q6_K blocks
    ``uint8 [rows, row_bytes]``."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 256).astype(np.float32)
    if ggml_type == Q2_K:  # per 16 values: w = d sc q - dmin m, q 0..3, sc and m 4 bits
        sub = blocks.reshape(-1, 16, 16)
        low = np.minimum(sub.min(-1), 0)
        scale = (sub.max(-1) - low) / 3
        d = (np.maximum(scale.max(-1, keepdims=True), 1e-12) / 15).astype(np.float16).astype(np.float32)
        dmin = (np.maximum(-low.min(-1, keepdims=True), 1e-12) / 15).astype(np.float16).astype(np.float32)
        sc, m = np.clip(np.round(scale / d), 1, 15), np.clip(np.round(-low / dmin), 0, 15)
        codes = np.clip(np.round((sub + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, 3).astype(np.uint8)
        parts = [(sc.astype(np.uint8) | (m.astype(np.uint8) << 4)), _two_bit_pack(codes.reshape(-1, 256)), _f16_bytes(d), _f16_bytes(dmin)]
    elif ggml_type == Q3_K:  # per 16 values: w = d (s - 32) (q - 4), q 0..7, s 6 bits
        sub = blocks.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 4
        d = (np.maximum(scale.max(-1, keepdims=True), 1e-12) / 31).astype(np.float16).astype(np.float32)
        s6 = np.clip(np.round(scale / d), 1, 31).astype(np.int32)  # the scale's code less 32
        codes = (np.clip(np.round(sub / (d * s6)[..., None]), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
        hmask = sum((codes.reshape(-1, 8, 32)[:, bit] >> 2) << bit for bit in range(8)).astype(np.uint8)
        u = (s6 + 32).astype(np.uint8)  # 16 six-bit values -> 12 bytes (llama.cpp's kmask layout)
        u0, u1, u2, u3 = u[:, 0:4], u[:, 4:8], u[:, 8:12], u[:, 12:16]
        high = (u0 >> 4) | ((u1 >> 4) << 2) | ((u2 >> 4) << 4) | ((u3 >> 4) << 6)
        scales = np.concatenate([(u0 & 15) | ((u2 & 15) << 4), (u1 & 15) | ((u3 & 15) << 4), high], -1)
        parts = [hmask, _two_bit_pack(codes & 3), scales, _f16_bytes(d)]
    elif ggml_type in (Q4_K, Q5_K):
        codes, d, dmin, sc, m = _q45_k(blocks.reshape(-1, 8, 32), 15 if ggml_type == Q4_K else 31)
        codes = codes.reshape(-1, 256)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m)]
        if ggml_type == Q5_K:
            high = (codes >> 4).reshape(-1, 8, 32)
            parts.append(sum(high[:, j] << j for j in range(8)).astype(np.uint8))
        parts.append(_nibble_pack(codes & 0x0F))
    elif ggml_type == Q6_K:
        sub = blocks.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = (np.maximum(np.abs(scale).max(-1, keepdims=True), 1e-12) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(scale / d), 1, 127)
        codes = (np.clip(np.round(sub / (d * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
        ql = np.concatenate([codes[:, :, 0] & 0x0F | (codes[:, :, 2] & 0x0F) << 4, codes[:, :, 1] & 0x0F | (codes[:, :, 3] & 0x0F) << 4], -1)
        qh = (codes[:, :, 0] >> 4) | (codes[:, :, 1] >> 4) << 2 | (codes[:, :, 2] >> 4) << 4 | (codes[:, :, 3] >> 4) << 6
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)]
    else:
        raise ValueError(f"quantize_k encodes Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, not type {ggml_type}")
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(rows, -1)


def _iq4_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    # the nearest of IQ4_VALUES to x / scale, per value (scale broadcast over x's last axis)
    table = np.array(IQ4_VALUES, dtype=np.float32)
    target = np.divide(x, scale[..., None], out=np.zeros_like(x), where=scale[..., None] != 0)
    return np.abs(target[..., None] - table).argmin(-1).astype(np.uint8)


def quantize_iq4(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """``x [rows, cols]`` as IQ4_NL (blocks of 32) or IQ4_XS (super-blocks of 256) blocks: each
    group's largest magnitude on the table's -127, the rest on the nearest table value."""
    rows = x.shape[0]
    groups = x.reshape(-1, 32).astype(np.float32)
    peak = groups[np.arange(len(groups)), np.abs(groups).argmax(-1)]
    scale = -peak / 127  # the largest magnitude on -127
    if ggml_type == IQ4_NL:
        d = scale.astype(np.float16).astype(np.float32)
        codes = _iq4_codes(groups, d)
        return np.concatenate([_f16_bytes(d[:, None]), _nibble_pack32(codes)], -1).reshape(rows, -1)
    scale = scale.reshape(-1, 8)
    d = (np.abs(scale).max(-1, keepdims=True) / 32).astype(np.float16).astype(np.float32)
    ls = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d != 0)), -32, 31).astype(np.int32)
    codes = _iq4_codes(groups.reshape(-1, 8, 32), d * ls)
    u = (ls + 32).astype(np.uint32)
    high = sum(((u[:, i] >> 4) & 3) << (2 * i) for i in range(8)).astype(np.uint16)
    low = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    parts = [_f16_bytes(d), high[:, None].view(np.uint8), low, _nibble_pack32(codes.reshape(-1, 32)).reshape(-1, 128)]
    return np.concatenate(parts, -1).astype(np.uint8).reshape(rows, -1)


def _nibble_pack32(codes: np.ndarray) -> np.ndarray:
    # [n, 32] codes 0..15 -> [n, 16]: values 0..15 in the low nibbles, 16..31 in the high ones
    return (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """``x [rows, cols]`` as blocks of ``ggml_type`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS)."""
    if ggml_type in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K):
        return quantize_k(x, ggml_type)
    if ggml_type in (IQ4_NL, IQ4_XS):
        return quantize_iq4(x, ggml_type)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if ggml_type not in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        raise ValueError(f"no quantizer for GGUF type {ggml_type}")
    return gguf_quantize(x.astype(np.float32), GGMLQuantizationType(ggml_type))


def dequantize(blocks: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    """gguf-py's own decoding (what transformers' GGUF loader uses), ``[rows, cols]`` float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(blocks, GGMLQuantizationType(ggml_type)).reshape(shape).astype(np.float32)


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's q/k rows into llama.cpp's interleaved order (inverse of ``unpermute_rotary_rows``)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


#: llama.cpp's mixed recipes by name: most tensors in the first type, the output head and, on
#: the layers ``more_bits_layer`` picks, attention's value projection and the feed-forward's
#: down projection (experts too) in the second
MIXTURES = {"Q4_K_M": (Q4_K, Q6_K), "Q5_K_M": (Q5_K, Q6_K)}
#: the type llama.cpp writes instead of a K-quant where a tensor's width is not a multiple of 256
FALLBACKS = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}


def more_bits_layer(layer: int, num_layers: int) -> bool:
    """The layers llama.cpp's ``_M`` recipes give more bits: the first and last eighth, and
    every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def mixture_type(recipe: str, gguf_name: str, num_layers: int) -> int:
    """The block type ``recipe`` (a ``MIXTURES`` name) gives the tensor ``gguf_name``."""
    base, more = MIXTURES[recipe]
    if gguf_name == "output.weight":
        return more
    match = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down|ffn_down_exps)\.weight", gguf_name)
    return more if match and more_bits_layer(int(match.group(1)), num_layers) else base


def write_gguf(
    hf_folder: Path, out_path: Path, ggml_type: int | str, quantize_embedding: bool = False, tokenizer_from: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Write the model in ``hf_folder`` (an architecture of ``GGUF_ARCHITECTURES``) as a GGUF file
    laid out as llama.cpp's converter lays it out, its projections (and ``output.weight``, and
    with ``quantize_embedding`` ``token_embd``) in ``ggml_type`` (a type id, or the name of one of
    llama.cpp's mixed recipes, ``MIXTURES``, for a type per tensor); returns the weights as the file
    holds them, decoded, under the folder's own tensor names (for a transformers oracle). A
    config the format cannot state as llama.cpp reads it is refused. ``tokenizer_from``: a GGUF
    file whose tokenizer (every ``tokenizer.*`` field) the new file carries, for a vocabulary of
    the same size (llama.cpp needs one to load a file)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sonar_models.formats.gguf_metadata import GGUF_ARCHITECTURES

    config = AutoConfig.from_pretrained(hf_folder)
    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    arch = next((name for name, m in GGUF_ARCHITECTURES.items() if m.hf_architecture == config.architectures[0]), None)
    if arch is None:
        raise NotImplementedError(f"no GGUF layout for {config.architectures[0]}")
    mapping = GGUF_ARCHITECTURES[arch]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_vocab_size(config.vocab_size)
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from, config.vocab_size)
    else:
        writer.add_uint32("tokenizer.ggml.bos_token_id", config.bos_token_id)
        writer.add_uint32("tokenizer.ggml.eos_token_id", eos)
    rope_tensors = _write_rope(writer, arch, config, head_dim)
    if arch in ("gemma2", "gemma3"):
        _write_gemma_attention(writer, arch, config, head_dim)
    elif arch in ("qwen2moe", "qwen3moe"):
        _write_experts_metadata(writer, arch, config)
    elif arch == "phi3" and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    as_stored: dict[str, torch.Tensor] = {}

    def block_type(gguf_name: str, cols: int) -> int:
        if not isinstance(ggml_type, str):
            return ggml_type
        kind = mixture_type(ggml_type, gguf_name, config.num_hidden_layers)
        # a width K-quants cannot take: llama.cpp's fallback, a type of 32-value blocks
        return kind if cols % BLOCK_SIZES[kind][0] == 0 else FALLBACKS[kind]

    def add(gguf_name: str, hf: str, kind: int | None, rotary_heads: int | None = None) -> None:
        value = tensors[hf].float().numpy()
        kind = None if kind is None else block_type(gguf_name, value.shape[-1])
        if mapping.norm_shift and hf.endswith("norm.weight"):
            stored = (value + mapping.norm_shift).astype(np.float32)
            writer.add_tensor(gguf_name, stored)
            as_stored[hf] = torch.from_numpy(stored) - mapping.norm_shift  # as a reader gets it back
            return
        stored = value if rotary_heads is None else permute_rotary_rows(value, rotary_heads)
        if kind is None or kind not in BLOCK_SIZES:
            writer.add_tensor(gguf_name, (stored[0] if gguf_name.endswith("ffn_gate_inp_shexp.weight") else stored).astype(np.float32))
            as_stored[hf] = torch.from_numpy(value.astype(np.float32))
            return
        blocks = quantize(stored, kind)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(kind))
        decoded = dequantize(blocks, kind, stored.shape)
        if rotary_heads is not None:
            from sonar_models.formats.gguf_file import unpermute_rotary_rows

            decoded = unpermute_rotary_rows(torch.from_numpy(decoded), rotary_heads).numpy()
        as_stored[hf] = torch.from_numpy(decoded)

    add("token_embd.weight", "model.embed_tokens.weight", ggml_type if quantize_embedding else None)
    add("output_norm.weight", "model.norm.weight", None)
    if "lm_head.weight" in tensors and not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight", ggml_type)
    for name, value in rope_tensors.items():
        writer.add_tensor(name, value)
    module_names = {hf_module: gguf_module for gguf_module, hf_module in mapping.layer_names.items()}
    experts: dict[tuple[str, str], dict[int, str]] = {}  # (layer, projection) -> expert -> tensor name
    for hf in tensors:
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", hf)
        if match:
            experts.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = hf
    for (layer, projection), names in sorted(experts.items(), key=lambda item: (int(item[0][0]), item[0][1])):
        ordered = [names[e] for e in range(len(names))]
        stack = np.stack([tensors[name].float().numpy() for name in ordered])  # [E, rows, cols]
        kind = block_type(f"blk.{layer}.ffn_{projection}_exps.weight", stack.shape[-1])
        if kind not in BLOCK_SIZES:
            writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.weight", stack.astype(np.float32))
            as_stored.update({name: torch.from_numpy(stack[expert].copy()) for expert, name in enumerate(ordered)})
            continue
        blocks = quantize(stack.reshape(-1, stack.shape[-1]), kind)
        blocks = blocks.reshape(stack.shape[0], stack.shape[1], -1)
        writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.weight", blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(kind))
        decoded = dequantize(blocks.reshape(-1, blocks.shape[-1]), kind, (stack.shape[0] * stack.shape[1], stack.shape[2]))
        for expert, name in enumerate(ordered):
            as_stored[name] = torch.from_numpy(decoded.reshape(stack.shape)[expert].copy())
    for hf in sorted(tensors, key=_layer_order):
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
        if match is None or hf in as_stored:
            continue
        layer, module, leaf = match.groups()
        if module not in module_names:
            raise NotImplementedError(f"no GGUF name for {hf!r} in a {arch} file")
        rotary_heads = None
        if mapping.permuted_qk:
            rotary_heads = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(module)
        floating = leaf != "weight" or module.endswith("norm") or module in ("mlp.gate", "mlp.shared_expert_gate")  # llama.cpp keeps routers in F32
        add(f"blk.{layer}.{module_names[module]}.{leaf}", hf, None if floating else ggml_type, rotary_heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return as_stored


def _copy_tokenizer(writer: Any, source: Path, vocab_size: int) -> None:
    from sonar_models.formats.gguf_metadata import open_gguf

    reader = open_gguf(source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.count != vocab_size:
        raise ValueError(f"{source} has {0 if tokens is None else tokens.count} tokens; the model's vocabulary is {vocab_size}")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def _layer_order(name: str) -> tuple[int, str]:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return (int(match.group(1)) if match else -1, name)


def _write_rope(writer: Any, arch: str, config: Any, head_dim: int) -> dict[str, np.ndarray]:
    """The rotary metadata llama.cpp reads for ``arch``; returns the tensors that carry the
    rest (Phi-3's LongRoPE factors)."""
    import gguf

    params = dict(config.rope_parameters or {})
    if arch == "gemma3":
        sliding = params.get("sliding_attention", {})
        if sliding.get("rope_type", "default") != "default" or float(sliding.get("rope_theta", 10000.0)) != 10000.0:
            raise NotImplementedError("llama.cpp rotates Gemma 3's sliding layers with base 10000 and no scaling")
        params = dict(params.get("full_attention", {}))
    writer.add_rope_freq_base(float(params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", "default")
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    if partial != 1.0 and arch != "phi3":
        raise NotImplementedError(f"a partial rotary dimension in a {arch} GGUF")
    rotary_dim = int(head_dim * partial)
    if arch == "phi3":
        writer.add_rope_dimension_count(rotary_dim)
        original = int(getattr(config, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings") or config.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
    if rope_type == "default":
        return {}
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
        return {}
    if rope_type == "longrope" and arch == "phi3":
        scale = config.max_position_embeddings / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(float(params.get("attention_factor") or default))
        return {name: np.asarray(params[key], dtype=np.float32) for name, key in
                (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor"))}
    raise NotImplementedError(f"writing {rope_type!r} rotary scaling to a {arch} GGUF")


def _write_experts_metadata(writer: Any, arch: str, config: Any) -> None:
    """Experts in every layer, renormalised as llama.cpp does for ``arch`` (the file cannot
    say otherwise)."""
    from sonar_models.formats.gguf_metadata import MOE_NORM_TOPK

    if list(getattr(config, "mlp_only_layers", None) or []) or int(getattr(config, "decoder_sparse_step", 1)) != 1:
        raise NotImplementedError(f"llama.cpp runs experts in every layer of a {arch} GGUF; the config keeps dense layers")
    if bool(config.norm_topk_prob) != MOE_NORM_TOPK[arch]:
        raise NotImplementedError(f"llama.cpp {'renormalises' if MOE_NORM_TOPK[arch] else 'does not renormalise'} the chosen experts of a {arch} GGUF; the config says norm_topk_prob={config.norm_topk_prob}")
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _write_gemma_attention(writer: Any, arch: str, config: Any, head_dim: int) -> None:
    """Gemma 2 and 3: the window, the caps; the score scale and which layers slide must be
    what llama.cpp derives, as the file cannot say otherwise."""
    from sonar_models.formats.gguf_metadata import GEMMA_27B_LAYERS, SLIDING_PATTERNS

    layers = config.num_hidden_layers
    pattern = SLIDING_PATTERNS[arch]
    derived = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)]
    if list(config.layer_types) != derived:
        raise NotImplementedError(f"llama.cpp slides every layer but each {pattern}th in a {arch} GGUF; the config's layers are {config.layer_types}")
    scalar = config.hidden_size // config.num_attention_heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
    if config.query_pre_attn_scalar != scalar:
        raise NotImplementedError(f"llama.cpp scales a {arch} GGUF's queries by 1/sqrt({scalar}); the config says query_pre_attn_scalar={config.query_pre_attn_scalar}")
    writer.add_sliding_window(config.sliding_window)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
