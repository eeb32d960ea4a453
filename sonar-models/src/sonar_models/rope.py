"""Rotary position embeddings: inverse frequencies from a Hugging Face config, cos/sin per token.

Supported ``rope_type``: ``default``, ``linear``, ``llama3``, ``yarn``, ``dynamic`` (NTK) and
``longrope`` (``su``). The parameters are read from ``config.rope_parameters`` (transformers 5)
or ``config.rope_scaling`` + ``config.rope_theta`` (transformers 4).

Two types depend on the sequence's length, which transformers re-decides on every forward
pass from the pass's last position. Here each position decides for itself, so a request's
rotary angles never depend on the rest of the batch: ``longrope`` takes its long factors at
positions from ``original_max_position_embeddings`` on, the short ones before; ``dynamic``
stretches its base at position ``p`` as transformers does for a sequence of ``p + 1``
tokens. That equals transformers on every decoded token and on prompts within those lengths;
a prompt that crosses them in one pass keeps the unstretched angles on its early positions,
where transformers stretches the whole pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


#: the supported ``rope_type`` values, and what each does (the generated model matrix lists them)
ROPE_TYPES = {
    "default": "the config's base, unscaled",
    "linear": "positions divided by `factor`; the context stretched by `factor`",
    "llama3": "Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between interpolated",
    "yarn": "YaRN (`factor`, `original_max_position_embeddings`, `beta_fast`/`beta_slow`, `mscale`/`mscale_all_dim` or `attention_factor`, `truncate`); cos/sin scaled by its attention factor; the context stretched to the pretraining length times `factor`",
    "dynamic": "dynamic NTK: the base stretched at each position past `max_position_embeddings` as transformers does for that length; the context stretched by `factor`",
    "longrope": "LongRoPE (`su`; Phi-3): `short_factor` before `original_max_position_embeddings`, `long_factor` from there, cos/sin scaled by its attention factor",
}


@dataclass(slots=True)
class RopeSpec:
    """What decides a model's rotary frequencies."""

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048  # the config's; dynamic and longrope defaults read it

    def __post_init__(self) -> None:
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and at most head_dim={self.head_dim}")


def rope_spec_from_config(config: Any, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    """Read the rotary settings of a Hugging Face config (either generation of field names);
    ``layer_type`` picks one set where they are given per layer type (Gemma 3's
    ``rope_parameters["sliding_attention"]``)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # longrope's first name (early Phi-3 configs)
        rope_type = "longrope"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    max_position = getattr(config, "max_position_embeddings", None) or 2048
    if rope_type in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length beside the rope parameters; it takes precedence
        original = getattr(config, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(original or max_position)
    return RopeSpec(head_dim, int(head_dim * partial), float(theta), rope_type, params, int(max_position))


def _exponents(spec: RopeSpec) -> torch.Tensor:
    # on the CPU in float32 whatever the default device/dtype (models may be built on "meta")
    return torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / spec.rotary_dim


def inverse_frequencies(spec: RopeSpec) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies, scaled by the spec's rope type (for
    ``longrope`` the short factors', for ``dynamic`` the unstretched ones: see
    :func:`position_frequencies` for the frequencies a position uses)."""
    inv_freq = 1.0 / (spec.theta ** _exponents(spec))
    if spec.rope_type in ("default", "dynamic"):
        return inv_freq
    if spec.rope_type == "linear":
        return inv_freq / float(spec.scaling["factor"])
    if spec.rope_type == "llama3":
        return _llama3_scaled(inv_freq, spec.scaling)
    if spec.rope_type == "yarn":
        return _yarn_scaled(spec)
    if spec.rope_type == "longrope":
        return _longrope(spec, "short_factor")
    raise NotImplementedError(f"rope_type={spec.rope_type!r} is not supported yet (supported: {', '.join(ROPE_TYPES)})")


def position_frequencies(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """``[T, rotary_dim // 2]`` float32 inverse frequencies at each of ``positions`` (int, on
    the CPU): the same row everywhere, except for the length-dependent types (module doc)."""
    positions = positions.to("cpu", torch.int64)
    inv_freq = inverse_frequencies(spec)
    if spec.rope_type == "longrope":
        long = positions >= spec.scaling["original_max_position_embeddings"]
        return torch.where(long[:, None], _longrope(spec, "long_factor")[None, :], inv_freq[None, :])
    if spec.rope_type == "dynamic":
        # transformers' base for a sequence of p + 1 tokens (never below the config's length)
        factor, dim = float(spec.scaling["factor"]), spec.rotary_dim
        seq_len = torch.clamp(positions + 1, min=spec.max_position_embeddings).to(torch.float64)
        base = spec.theta * ((factor * seq_len / spec.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base.to(torch.float32)[:, None] ** _exponents(spec)[None, :])
    return inv_freq.expand(len(positions), -1)


def attention_factor(spec: RopeSpec) -> float:
    """The factor cos and sin are scaled by (YaRN's and LongRoPE's attention temperature; 1.0
    for the other types)."""
    scaling = spec.scaling or {}
    if scaling.get("attention_factor") is not None and spec.rope_type in ("yarn", "longrope"):
        return float(scaling["attention_factor"])
    if spec.rope_type == "yarn":
        factor = float(scaling["factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)
    if spec.rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = float(scaling.get("factor") or spec.max_position_embeddings / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaled(spec: RopeSpec) -> torch.Tensor:
    # wavelengths that turn few times over the pretraining length are interpolated (divided by
    # factor), those that turn many times kept, the band between ramped linearly
    scaling, dim, base = spec.scaling, spec.rotary_dim, spec.theta
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** _exponents(spec)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


def _longrope(spec: RopeSpec, which: str) -> torch.Tensor:
    factors = torch.tensor(spec.scaling[which], dtype=torch.float32, device="cpu")
    if factors.numel() != spec.rotary_dim // 2:
        raise ValueError(f"rope_scaling.{which} has {factors.numel()} entries; the rotary dimension {spec.rotary_dim} needs {spec.rotary_dim // 2}")
    return 1.0 / (factors * spec.theta ** _exponents(spec))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for a step's positions, computed in float32 and cast to the activations'
    dtype. The inverse frequencies are kept out of the module's buffers on purpose, so that
    ``model.to(bfloat16)`` never rounds them."""

    def __init__(self, spec: RopeSpec, max_position: int = 2048) -> None:
        super().__init__()
        self.spec = spec
        self.max_position = max_position  # rows of cos_sin_cache
        self._inv_freq = inverse_frequencies(spec)
        self._by_position = spec.rope_type in ("longrope", "dynamic")  # frequencies vary with the position
        self._scale = attention_factor(spec)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self._cos_sin_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self._inv_freq.to(device)
        return self._inv_freq_by_device[device]

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, rotary_dim // 2]`` float32 angles of ``positions``, on their device."""
        if self._by_position:
            return positions.float()[:, None] * position_frequencies(self.spec, positions).to(positions.device)
        return positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """``[max_position, rotary_dim]`` float32: cos of each position's angles in the first
        half, sin in the second, both times the rope type's attention factor (for platform
        rotary kernels); built once per device."""
        if device not in self._cos_sin_by_device:
            freqs = self._angles(torch.arange(self.max_position, device="cpu"))
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
            self._cos_sin_by_device[device] = (table * self._scale if self._scale != 1.0 else table).to(device)
        return self._cos_sin_by_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, rotary_dim // 2] -> [T, rotary_dim]
        if self._by_position:  # the table's rows (scaled already): no per-step frequencies
            cos, sin = self.cos_sin_cache(positions.device)[positions].chunk(2, dim=-1)
            return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)
        freqs = self._angles(positions)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self._scale != 1.0:
            cos, sin = cos * self._scale, sin * self._scale
        return cos.to(dtype), sin.to(dtype)
