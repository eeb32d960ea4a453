"""A small round-to-nearest int4 quantizer that writes GPTQ and AWQ checkpoints of a float
Hugging Face folder in those tools' on-disk layouts, plus the same model with the dequantized
weights (what transformers runs as the oracle). Packing is written out here from the formats'
descriptions, independently of the loader under test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SHARED_BY = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: torch.Tensor, columns_of_nibble: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack ``[rows, 8m]`` 4-bit values 8 per int32 along the last dim."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for nibble, column in enumerate(columns_of_nibble):
        words |= (values[:, column::8].to(torch.int64) & 0xF) << (4 * nibble)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize_groups(w: torch.Tensor, groups: torch.Tensor, num_groups: int, sym: bool, min_zero: int) -> tuple:
    """``w`` ``[in, out]`` float32, ``groups[k]`` the group of input k: ``(q [in, out], scales
    [G, out] fp16, zeros [G, out])``, with ``w ~ (q - zeros[groups]) * scales[groups]``."""
    scales = torch.empty(num_groups, w.shape[1], dtype=torch.float16)
    zeros = torch.empty(num_groups, w.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = w[groups == g]
        if sym:
            scale = (2 * rows.abs().amax(0) / 15).clamp(min=1e-6)
            zero = torch.full_like(scale, 8, dtype=torch.int64)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-6)
            zero = torch.round(-lo / scale).to(torch.int64).clamp(min_zero, 15)
        scales[g], zeros[g] = scale.half(), zero
    s, z = scales.float()[groups], zeros[groups]
    q = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int64)
    return q, scales, zeros


def _gptq_tensors(w: torch.Tensor, group_size: int, sym: bool, order: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    in_features = w.shape[1]
    size = in_features if group_size == -1 else group_size
    position = torch.arange(in_features) if order is None else torch.argsort(order)  # where input k comes in quantizing order
    g_idx = position // size
    # classic GPTQ stores zero - 1 in 4 bits, so it cannot hold a zero point of 0
    q, scales, zeros = _quantize_groups(w.t().float(), g_idx, in_features // size, sym, min_zero=1)
    tensors = {
        "qweight": _pack(q.t()).t().contiguous(),  # [in / 8, out]: packed along the input dim
        "qzeros": _pack(zeros - 1),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    dequantized = (q - zeros[g_idx]).float() * scales.float()[g_idx]
    return tensors, dequantized.t()


def _awq_tensors(w: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    in_features = w.shape[1]
    size = in_features if group_size == -1 else group_size
    groups = torch.arange(in_features) // size
    q, scales, zeros = _quantize_groups(w.t().float(), groups, in_features // size, sym=False, min_zero=0)
    tensors = {
        "qweight": _pack(q, AWQ_COLUMN_OF_NIBBLE),  # [in, out / 8]
        "qzeros": _pack(zeros, AWQ_COLUMN_OF_NIBBLE),
        "scales": scales,
    }
    dequantized = (q - zeros[groups]).float() * scales.float()[groups]
    return tensors, dequantized.t()


def write_int4_checkpoint(source: Path, root: Path, fmt: str, group_size: int, sym: bool = False, desc_act: bool = False) -> tuple[Path, Path]:
    """``(quantized folder, dequantized float folder)`` of the float folder ``source``, as
    ``fmt`` (``"gptq"`` or ``"awq"``) writes it; the decoder projections are quantized and
    everything else (embeddings, norms, ``lm_head``) stays as it is."""
    quantized, dequantized = root / "quantized", root / "dequantized"
    for folder in (quantized, dequantized):
        shutil.copytree(source, folder, dirs_exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    quant_tensors, float_tensors = {}, {}
    generator = torch.Generator().manual_seed(7)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        layer, _, projection = module.rpartition(".")
        if leaf != "weight" or projection not in PROJECTIONS:
            quant_tensors[name] = float_tensors[name] = tensor
            continue
        if fmt == "gptq":
            order = None
            if desc_act:  # one activation order per input, shared by the projections that read it
                key = (layer.rpartition(".")[0], INPUT_SHARED_BY[projection])
                order = orders.setdefault(key, torch.randperm(tensor.shape[1], generator=generator))
            packed, weight = _gptq_tensors(tensor, group_size, sym, order)
        else:
            packed, weight = _awq_tensors(tensor, group_size)
        quant_tensors.update({f"{module}.{key}": value for key, value in packed.items()})
        float_tensors[name] = weight.to(tensor.dtype)
    save_file(quant_tensors, str(quantized / "model.safetensors"))
    save_file(float_tensors, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    if fmt == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
            "model_name_or_path": None, "model_file_base_name": None,
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None,
        }  # fmt: skip
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dequantized
