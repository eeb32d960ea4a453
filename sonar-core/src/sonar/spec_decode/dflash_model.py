"""The DFlash backbone and DSpark's heads, as plain PyTorch modules.

The target's hidden states of the chosen layers go once through ``fc`` and ``hidden_norm``;
every draft layer projects that context to keys and values of its own (``k_proj``/``v_proj``,
``k_norm``, rotary at the context's positions). A block of slots ``[anchor, mask, ...]`` (the
target's embeddings of those ids) then runs through the layers; each slot's query attends,
without a causal mask, to the context keys before the anchor and to every key of its own
block. The final norm's output goes through the target's LM head.

DSpark adds (``markov_head``) a bias on each slot's logits from the token before it (the
anchor, then the draft before), so drafts are picked left to right, and (``confidence_head``)
a logit per slot whose sigmoid is the chance the slot's draft is accepted given the ones
before were; their running product is the chance a prefix survives verification.

Module names are those of the published checkpoints (``layers.N.self_attn.q_proj``, ``fc``,
``hidden_norm``, ``norm``, ``markov_head.markov_w1``, ``confidence_head.proj``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sonar import ops
from sonar.spec_decode.dflash_config import DFlashConfig
from sonar.spec_decode.eagle3_head import GatedMLP, RMSNorm, apply_rotary, rotary_dim_of

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values [..., L, kv_heads, head_dim]


#: device types whose platform rotary (``sonar.ops.apply_rotary``) rotates in float32 from a
#: per-position float32 table, as the drafter's own rotation does: there drafting takes it (one
#: launch for a layer's queries and keys instead of about ten elementwise ones). The CPU
#: platform's tables are rounded to the model's dtype, so the CPU keeps the torch rotation.
FUSED_ROTARY_DEVICES = {"cuda"}


class DFlashRotary(nn.Module):
    """Rotary tables of the draft layers (scaled variants through transformers' initialisers)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        scaling = dict(config.rope_scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        self.attention_scaling = 1.0
        if kind == "default":
            dim = rotary_dim_of(config.head_dim, scaling)
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(
                hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads, head_dim=config.head_dim,
                rope_theta=config.rope_theta, rope_scaling=scaling, max_position_embeddings=config.max_position_embeddings,
            )  # fmt: skip
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        #: positions the platform's table covers (``cos_sin_cache``); the proposer raises it to
        #: its cache's longest request before the table is first built
        self.max_position = config.max_position_embeddings
        self._cos_sin_by_device: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` -> ``(cos, sin)`` ``[N, head_dim / 2]``."""
        freqs = positions.reshape(-1).float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """``[max_position, rotary_dim]`` float32, cos in the first half and sin in the second
        (a platform rotary kernel's table); built once per device, on the CPU."""
        device = torch.device(device)
        table = self._cos_sin_by_device.get(device)
        if table is None or table.shape[0] < self.max_position:  # first use, or max_position raised since
            cos, sin = self.forward(torch.arange(self.max_position))
            self._cos_sin_by_device[device] = torch.cat([cos, sin], dim=-1).to(device)
        return self._cos_sin_by_device[device]

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """The rotation of ``positions [...]``: the platform's fused one when drafting on a
        device of ``FUSED_ROTARY_DEVICES`` (no table work a forward), else ``forward``'s."""
        if not torch.is_grad_enabled() and positions.device.type in FUSED_ROTARY_DEVICES and ops.platform_op(positions, "apply_rotary"):
            flat = positions.reshape(-1)
            return RotaryTables(None, None, (flat, self.cos_sin_cache(positions.device)))
        cos, sin = self(positions)
        return RotaryTables(cos, sin, None)


@dataclass(frozen=True, slots=True)
class RotaryTables:
    """The rotation of N positions, made once a forward (every layer's queries and keys share
    it): ``cos``/``sin`` ``[N, rotary_dim / 2]`` for the torch rotation, or the platform's
    ``(positions, cos_sin_cache)`` for its fused one."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    platform: tuple[torch.Tensor, torch.Tensor] | None


def rotate(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate ``[..., heads, D]`` by the ``tables`` of its positions."""
    return rotate_pair(None, x, tables)[1]


def rotate_pair(q: torch.Tensor | None, k: torch.Tensor, tables: RotaryTables) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Rotate queries ``[..., H, D]`` (or none) and keys ``[..., KVH, D]`` of the same
    positions: one platform launch for both, or the torch rotation of each."""
    keys = k.reshape(-1, k.shape[-2], k.shape[-1])
    queries = None if q is None else q.reshape(-1, q.shape[-2], q.shape[-1])
    if tables.platform is not None:  # in place where the platform can: use what it returns
        queries, keys = ops.apply_rotary(keys.new_empty((keys.shape[0], 0, keys.shape[-1])) if q is None else queries, keys, tables.platform)
    else:
        keys = apply_rotary(keys, tables.cos, tables.sin)
        queries = None if q is None else apply_rotary(queries, tables.cos, tables.sin)
    return (None if q is None else queries.reshape(q.shape)), keys.reshape(k.shape)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, tables: RotaryTables) -> LayerKV:
        """``x [..., hidden]`` -> keys rotated by ``tables`` (of ``x``'s positions) and values
        ``[..., kv_heads, head_dim]``."""
        k, v = self.unrotated_keys_values(x)
        return rotate(k, tables), v

    def unrotated_keys_values(self, x: torch.Tensor) -> LayerKV:
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return k, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, tables: RotaryTables, context: LayerKV, mask: torch.Tensor) -> torch.Tensor:
        """``x [B, Q, hidden]`` with the rotary ``tables`` of its positions (``B * Q`` rows);
        ``context`` keys/values ``[B, L, KVH, D]``; ``mask [B, 1, Q, L + Q]`` (True: attended)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        k, v = attn.unrotated_keys_values(h)
        q, k = rotate_pair(attn.q_norm(attn.q_proj(h).unflatten(-1, (attn.num_heads, attn.head_dim))), k, tables)
        keys = torch.cat([context[0], k], dim=1).transpose(1, 2)  # [B, KVH, L + Q, D]
        values = torch.cat([context[1], v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=attn.head_dim**-0.5, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov head: ``bias(prev) = markov_w2(markov_w1[prev])`` (vanilla),
    gated by ``sigmoid(gate_proj([h, w1[prev]]))`` (gated), or through a GRU-like state over
    the block (rnn, ``joint_proj``)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        rank, vocab, hidden = config.markov_rank, config.vocab_size, config.hidden_size
        self.kind = config.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The recurrent state before a block's first slot (rnn only) ``[..., rank]``."""
        return hidden.new_zeros(*hidden.shape[:-1], self.rank) if self.kind == "rnn" else None

    def step(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits bias ``[..., vocab]`` of one slot from the token before it, and the new state."""
        prev = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(prev), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev], dim=-1)))
            return self.markov_w2(gate * prev), state
        gate_raw, candidate_raw, output_raw = self.joint_proj(torch.cat([state, prev, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate_raw)
        return self.markov_w2(torch.tanh(output_raw)), state


class ConfidenceHead(nn.Module):
    """A linear logit per slot over its hidden state (and the Markov embedding of the token before)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()


class DFlashDrafter(nn.Module):
    """The drafter's own modules; the target's embedding and LM head are passed in, never owned."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.markov_head = MarkovHead(config) if config.markov_rank else None
        self.confidence_head = None
        if config.enable_confidence_head:
            width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)
        self.rotary = DFlashRotary(config)

    def context(self, target_states: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        """Per draft layer, the keys and values ``[..., kv_heads, head_dim]`` of the target's
        states ``[..., num_target_layers * hidden]`` at ``positions [...]``."""
        x = self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))
        tables = self.rotary.tables(positions)
        return [layer.self_attn.keys_values(x, tables) for layer in self.layers]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, context: list[LayerKV], masks: list[torch.Tensor]) -> torch.Tensor:
        """The normed hidden states ``[B, Q, hidden]`` of slots ``embeds [B, Q, hidden]`` at
        ``positions [B, Q]``, each layer attending to ``context[layer]`` and the slots under
        ``masks[layer]`` ``[B, 1, Q, L + Q]``."""
        x = embeds.to(self.fc.weight.dtype)
        tables = self.rotary.tables(positions)
        for layer, kv, mask in zip(self.layers, context, masks):
            x = layer(x, tables, kv, mask)
        return self.norm(x)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Per slot, the logit of its draft being accepted (its prefix accepted); None without a head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.prev_embeddings(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)

    def teacher_forced_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Training: float32 logits ``[..., n, vocab]`` of slots ``hidden [..., n, hidden]``
        through the target's head ``head_weight [vocab, hidden]``, plus the Markov bias of the
        known tokens before each slot (``prev_ids [..., n]``), slot by slot over the last-but-one
        axis. A stateless Markov head's bias joins the head's product (one product over
        ``[hidden, w1[prev]]``), so no vocabulary-wide tensor is added or converted twice."""
        head = head_weight.to(hidden.dtype)
        markov = self.markov_head
        if markov is None:
            return (hidden @ head.T).float()
        if markov.kind == "vanilla":
            prev = markov.prev_embeddings(prev_ids).to(hidden.dtype)
            weight = torch.cat([head, markov.markov_w2.weight.to(hidden.dtype)], dim=1)
            return (torch.cat([hidden, prev], dim=-1) @ weight.T).float()
        base = (hidden @ head.T).float()
        if markov.kind != "rnn":  # no state: every slot at once
            return base + markov.step(prev_ids, hidden, None)[0].float()
        state = markov.initial_state(hidden[..., 0, :])
        out = []
        for j in range(base.shape[-2]):
            bias, state = markov.step(prev_ids[..., j], hidden[..., j, :], state)
            out.append(base[..., j, :] + bias.float())
        return torch.stack(out, dim=-2)

    def pick_greedy(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting: the argmax drafts ``[R, n]`` of ``base_logits [R, n, vocab]``, left to right
        through the Markov head where there is one, and the tokens before each slot ``[R, n]``."""
        if self.markov_head is None:
            drafts = ops.argmax(base_logits.reshape(-1, base_logits.shape[-1])).view(base_logits.shape[:-1])
            return drafts, torch.cat([anchor_ids[:, None], drafts[:, :-1]], dim=1)
        state = self.markov_head.initial_state(hidden[:, 0])
        prev, drafts, prevs = anchor_ids, [], []
        for j in range(base_logits.shape[1]):
            bias, state = self.markov_head.step(prev, hidden[:, j], state)
            prevs.append(prev)
            prev = ops.argmax(base_logits[:, j] + bias.float())
            drafts.append(prev)
        return torch.stack(drafts, dim=1), torch.stack(prevs, dim=1)
