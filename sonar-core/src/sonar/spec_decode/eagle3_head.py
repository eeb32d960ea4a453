"""The EAGLE-3 draft head: an fc over the concatenated auxiliary hidden states of the target,
one Llama decoder layer whose attention reads ``[norm(token embedding), norm(hidden)]``
(twice the hidden size), a final norm and a head over a reduced draft vocabulary.

Module names are those of the published checkpoints (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), so a checkpoint's state dict loads as it is. The attention
itself is left to the caller (``attend``): the proposer attends over per-request draft caches,
the trainer over its training-time-test masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from sonar import ops

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> out


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The fields of an EAGLE-3 ``config.json`` the head is built from.

    :param hidden_size: the head's width (the target's, in every published checkpoint).
    :param target_hidden_size: the width of each auxiliary state the fc reads.
    :param num_aux_layers: how many auxiliary states are concatenated (3 in EAGLE-3).
    :param vocab_size: the target's vocabulary.
    :param draft_vocab_size: the head's reduced vocabulary (``d2t`` maps it back).
    :param norm_before_residual: the residual taken after ``hidden_norm`` instead of before it.
    :param aux_layer_ids: ``eagle_aux_hidden_state_layer_ids`` (None: the EAGLE-3 default).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    num_aux_layers: int = 3
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) must be in 1..vocab_size ({self.vocab_size})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        """From a checkpoint's ``config.json`` (missing optional fields take Llama's defaults).

        :raises ValueError: a required field is missing.
        """
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in raw]
        if missing:
            raise ValueError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is None and isinstance(raw.get("eagle_config"), dict):
            ids = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` of the published layout (Llama fields plus EAGLE-3's own)."""
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[0]],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": False,
        }
        if self.rope_scaling is not None:
            raw["rope_scaling"] = self.rope_scaling
        if self.aux_layer_ids is not None:
            raw["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return raw


class RMSNorm(nn.Module):
    """A drafter's RMSNorm: the platform's fused one (``sonar.ops.rms_norm``, one launch) when
    drafting, the same arithmetic in torch operations when training (autograd)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position tables; scaled variants (``rope_scaling``) through transformers'
    own initialisers."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        scaling = dict(config.rope_scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        self.attention_scaling = 1.0
        if kind == "default":
            dim = rotary_dim_of(config.head_dim, scaling)
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = LlamaConfig(**{**config.to_dict(), "rope_scaling": scaling})
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, D/2]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[N, heads, D]`` by the tables of its rows (halves layout, as Llama); tables of
    ``R / 2 < D / 2`` columns rotate the first ``R`` dims and pass the rest (partial rotary)."""
    rotary_dim = 2 * cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
    return torch.cat([out, passed], dim=-1) if passed.shape[-1] else out


def rotary_dim_of(head_dim: int, scaling: dict[str, Any]) -> int:
    """The rotated dims of a head: all of them, or ``partial_rotary_factor`` of them."""
    return int(head_dim * float(scaling.get("partial_rotary_factor") or 1.0))


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        width = 2 * config.hidden_size  # [embedding, hidden]
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


class GatedMLP(nn.Module):
    """The Llama-style SiLU-gated MLP of a drafter layer (EAGLE-3, DFlash)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class Eagle3Head(nn.Module):
    """The draft head (``embed_tokens`` is the target's: passed in, never owned).

    One call runs the layer over ``N`` slots: slot ``j`` carries a hidden state (the fc over
    the target's auxiliary states at position ``j``, or the head's own output of the slot
    before) and the embedding of the token at ``j + 1``; its output predicts the token at
    ``j + 2``.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_aux_layers * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(config)

    def combine(self, aux_states: torch.Tensor) -> torch.Tensor:
        """``[N, num_aux * target_hidden]`` -> ``[N, hidden]``."""
        return self.fc(aux_states.to(self.fc.weight.dtype))

    def project(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[N, H, D]``, keys and values ``[N, KVH, D]`` (rotated) and the residual."""
        layer = self.midlayer
        embeds = layer.input_layernorm(embeds.to(hidden.dtype))
        if self.config.norm_before_residual:
            hidden = residual = layer.hidden_norm(hidden)
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)  # [N, 2 * hidden]
        attn = layer.self_attn
        n = x.shape[0]
        q = attn.q_proj(x).view(n, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(n, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(n, attn.num_kv_heads, attn.head_dim)
        cos, sin = self.rotary(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's output ``[N, H, D]``: ``(normed, prenorm)``, the state the
        head's logits read and the one fed to the next drafting step."""
        layer = self.midlayer
        hidden = layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1)) + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(hidden)) + hidden
        return self.norm(prenorm), prenorm

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, prenorm)`` of ``N`` slots; ``attend(q, k, v)`` does the attention."""
        q, k, v, residual = self.project(hidden, embeds, positions)
        return self.finish(attend(q, k, v), residual)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary ``[N, draft_vocab]``."""
        return self.lm_head(normed).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``i + d2t[i]``)."""
        return draft_ids + self.d2t[draft_ids]
