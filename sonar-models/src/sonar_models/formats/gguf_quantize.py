"""A small GGUF quantizer of Sonar's own: float matrices into llama.cpp's block formats, and a
Hugging Face Llama folder into a ``.gguf`` file (for tests; no llama.cpp needed).

Q4_0, Q4_1 and Q8_0 use ``gguf.quants.quantize``; the K-quants, which it lacks, are encoded
here with plain per-block min/max scales (llama.cpp searches its scales; any valid encoding
decodes the same way).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sonar_models.formats.gguf_blocks import BLOCK_SIZES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


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


def quantize_k(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """``x [rows, cols]`` (cols a multiple of 256) as Q4_K, Q5_K or Q6_K blocks ``uint8 [rows, row_bytes]``."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 256).astype(np.float32)
    if ggml_type in (Q4_K, Q5_K):
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
        raise ValueError(f"quantize_k encodes Q4_K, Q5_K and Q6_K, not type {ggml_type}")
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(rows, -1)


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """``x [rows, cols]`` as blocks of ``ggml_type`` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)."""
    if ggml_type in (Q4_K, Q5_K, Q6_K):
        return quantize_k(x, ggml_type)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if ggml_type not in (Q4_0, Q4_1, Q8_0):
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


def write_llama_gguf(hf_folder: Path, out_path: Path, ggml_type: int, quantize_embedding: bool = False) -> dict[str, torch.Tensor]:
    """Write the Llama in ``hf_folder`` as a GGUF file whose projections (and ``output.weight``,
    and with ``quantize_embedding`` ``token_embd``) are ``ggml_type``; returns the weights as
    the file holds them, dequantized, under Hugging Face names (for a transformers oracle)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(hf_folder) / "config.json").read_text())
    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", config["bos_token_id"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    as_stored: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf: str, value: np.ndarray, kind: int | None, heads: int | None = None) -> None:
        stored = value if heads is None else permute_rotary_rows(value, heads)
        if kind is None or kind not in BLOCK_SIZES:
            writer.add_tensor(gguf_name, stored.astype(np.float32))
            as_stored[hf] = torch.from_numpy(value.astype(np.float32))
            return
        blocks = quantize(stored, kind)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(kind))
        decoded = dequantize(blocks, kind, stored.shape)
        if heads is not None:
            from sonar_models.formats.gguf_file import unpermute_rotary_rows

            decoded = unpermute_rotary_rows(torch.from_numpy(decoded), heads).numpy()
        as_stored[hf] = torch.from_numpy(decoded)

    get = lambda name: tensors[name].float().numpy()  # noqa: E731
    add("token_embd.weight", "model.embed_tokens.weight", get("model.embed_tokens.weight"), ggml_type if quantize_embedding else None)
    add("output_norm.weight", "model.norm.weight", get("model.norm.weight"), None)
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings", False):
        add("output.weight", "lm_head.weight", get("lm_head.weight"), ggml_type)
    for i in range(config["num_hidden_layers"]):
        for hf_module, gguf_module in LAYER_TENSORS.items():
            name = f"model.layers.{i}.{hf_module}.weight"
            heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}.get(hf_module)
            add(f"blk.{i}.{gguf_module}.weight", name, get(name), None if "norm" in hf_module else ggml_type, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return as_stored
