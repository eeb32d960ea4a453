"""Rotary position embeddings: inverse frequencies from a Hugging Face config, cos/sin per token.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``. The parameters are read from
``config.rope_parameters`` (transformers 5) or ``config.rope_scaling`` + ``config.rope_theta``
(transformers 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class RopeSpec:
    """What decides a model's rotary frequencies."""

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and at most head_dim={self.head_dim}")


def rope_spec_from_config(config: Any, head_dim: int) -> RopeSpec:
    """Read the rotary settings of a Hugging Face config (either generation of field names)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return RopeSpec(head_dim, int(head_dim * partial), float(theta), rope_type, params)


def inverse_frequencies(spec: RopeSpec) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies, scaled by the spec's rope type."""
    # on the CPU in float32 whatever the default device/dtype (models may be built on "meta")
    exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / spec.rotary_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "default":
        return inv_freq
    if spec.rope_type == "linear":
        return inv_freq / float(spec.scaling["factor"])
    if spec.rope_type == "llama3":
        return _llama3_scaled(inv_freq, spec.scaling)
    raise NotImplementedError(
        f"rope_type={spec.rope_type!r} is not supported yet (supported: default, linear, llama3)"
    )


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
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self._cos_sin_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self._inv_freq.to(device)
        return self._inv_freq_by_device[device]

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """``[max_position, rotary_dim]`` float32: cos of each position's angles in the first
        half, sin in the second (for platform rotary kernels); built once per device."""
        if device not in self._cos_sin_by_device:
            positions = torch.arange(self.max_position, dtype=torch.float32)
            freqs = positions[:, None] * self._inv_freq[None, :]
            self._cos_sin_by_device[device] = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        return self._cos_sin_by_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, rotary_dim // 2] -> [T, rotary_dim]
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
