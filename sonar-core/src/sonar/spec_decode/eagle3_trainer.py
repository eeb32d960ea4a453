"""Training an EAGLE-3 head on the target's own states and distributions, with EAGLE-3's
training-time test.

Slot ``j`` of a sequence pairs a hidden state with the embedding of token ``j + 1`` and
learns the target's distribution at position ``j + 1`` (over the draft vocabulary). Step 0
feeds the fc of the target's auxiliary states at ``j``; step ``s`` feeds the head's own
output of step ``s - 1`` at ``j - 1``, exactly what drafting the ``s + 1``-th token sees,
and attends to step 0's keys up to ``j - s`` and to the keys of steps ``1 .. s`` on its
diagonal. The loss of step ``s`` (soft cross-entropy against the target) is weighted
``0.8 ** s``.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from sonar.spec_decode.eagle3_data import Sample
from sonar.spec_decode.eagle3_head import Eagle3Config, Eagle3Head
from sonar.spec_decode.train_schedule import index_batches, warmup_cosine

STEP_WEIGHT = 0.8


@dataclass(slots=True)
class TrainOptions:
    """How the head is trained: ``epochs`` over the samples in batches of ``batch_size``
    sequences, AdamW at ``lr`` (warm-up then cosine decay), ``ttt_steps`` training-time-test
    steps."""

    epochs: int = 2
    lr: float = 5e-4
    batch_size: int = 8
    ttt_steps: int = 3
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.ttt_steps < 1:
            raise ValueError("epochs, batch_size and ttt_steps must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(slots=True)
class Evaluation:
    """Held-out figures: per drafting step, how often the head's top-1 draft is the target's
    next token (given the earlier ones were right), and the mean acceptance length those
    rates imply for ``len(top1)`` drafts (1 + the expected run of accepted drafts)."""

    top1: list[float]
    loss: float
    num_positions: int

    @property
    def acceptance_length(self) -> float:
        run, total = 1.0, 1.0
        for rate in self.top1:
            run *= rate
            total += run
        return total


@dataclass(slots=True)
class TrainResult:
    epoch_losses: list[float] = field(default_factory=list)
    first_losses: list[float] = field(default_factory=list)  # the first batches' losses (learning check)


def head_config_for(target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> Eagle3Config:
    """A head shaped like one layer of the target (``target_config``: its transformers config)."""
    heads = target_config.num_attention_heads
    hidden = target_config.hidden_size
    return Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        intermediate_size=target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=hidden,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(target_config, "rope_theta", None) or 10000.0),
        rope_scaling=getattr(target_config, "rope_scaling", None),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", None) or 2048),
        num_aux_layers=len(aux_layer_ids),
        aux_layer_ids=tuple(aux_layer_ids),
    )


@dataclass(slots=True)
class _Batch:
    aux: torch.Tensor  # [B, N, A] slots j = 0 .. T-2
    embeds: torch.Tensor  # [B, N, hidden] token j + 1
    target: torch.Tensor  # [B, N, draft_vocab] the target's distribution at j + 1
    labels: torch.Tensor  # [B, N] the target's next token (j + 2), -1 where none
    learn: torch.Tensor  # [B, N] bool: slots whose label is a response token
    positions: torch.Tensor  # [B, N]


def _collate(samples: list[Sample], embed: torch.nn.Module, head_rows: torch.Tensor, device: torch.device) -> _Batch:
    n = max(len(s.token_ids) for s in samples) - 1
    b = len(samples)
    width, hidden = samples[0].aux_states.shape[-1], samples[0].final_states.shape[-1]
    aux = torch.zeros(b, n, width)
    final = torch.zeros(b, n, hidden)
    next_ids = torch.zeros(b, n, dtype=torch.int64)
    labels = torch.full((b, n), -1, dtype=torch.int64)
    learn = torch.zeros(b, n, dtype=torch.bool)
    for i, s in enumerate(samples):
        length = len(s.token_ids)
        ids = torch.tensor(s.token_ids, dtype=torch.int64)
        aux[i, : length - 1] = s.aux_states[: length - 1].float()
        final[i, : length - 1] = s.final_states[1:length].float()
        next_ids[i, : length - 1] = ids[1:]
        labels[i, : length - 2] = ids[2:]
        learn[i, : length - 2] = torch.arange(2, length) >= s.num_prompt_tokens
    with torch.no_grad():
        embeds = embed(next_ids.to(embed.weight.device)).float()
        target = torch.softmax(final.to(device) @ head_rows.to(device).T, dim=-1)
    positions = torch.arange(n).expand(b, n)
    return _Batch(aux.to(device), embeds.to(device), target, labels.to(device), learn.to(device), positions.to(device))


def _ttt_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """``[n, (step + 1) * n]``: slot ``j`` of ``step`` sees step 0's keys up to ``j - step``
    and step ``t``'s key at ``j - step + t``."""
    j = torch.arange(n, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    blocks = [i <= j - step] + [i == j - step + t for t in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_forward(head: Eagle3Head, batch: _Batch, ttt_steps: int) -> tuple[torch.Tensor, list[tuple[int, int]], int]:
    """The weighted loss of a batch, per step ``(top-1 hits, positions)``, and its positions."""
    b, n = batch.labels.shape
    cfg = head.config
    flat_positions = batch.positions.reshape(-1)
    embeds = batch.embeds.reshape(b * n, -1)
    hidden = head.combine(batch.aux.reshape(b * n, -1))
    keys, values, hits = [], [], []
    total = torch.zeros((), device=batch.labels.device)
    num_learned = 0
    slot = torch.arange(n, device=batch.labels.device)[None, :]
    for step in range(ttt_steps):
        q, k, v, residual = head.project(hidden, embeds, flat_positions)
        keys.append(k.view(b, n, cfg.num_key_value_heads, cfg.head_dim))
        values.append(v.view(b, n, cfg.num_key_value_heads, cfg.head_dim))
        mask = _ttt_mask(n, step, q.device)
        out = F.scaled_dot_product_attention(
            q.view(b, n, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2),
            torch.cat(keys, dim=1).transpose(1, 2),
            torch.cat(values, dim=1).transpose(1, 2),
            attn_mask=mask, scale=cfg.head_dim**-0.5, enable_gqa=True,
        ).transpose(1, 2)  # [B, N, H, D]
        normed, prenorm = head.finish(out.reshape(b * n, cfg.num_attention_heads, cfg.head_dim), residual)
        logits = head.logits(normed).view(b, n, -1)
        learn = batch.learn & (slot >= step) & (batch.labels >= 0)
        count = int(learn.sum())
        if count:
            loss = -(batch.target * F.log_softmax(logits, dim=-1)).sum(-1)
            total = total + STEP_WEIGHT**step * loss[learn].mean()
            drafted = head.to_target_ids(logits.argmax(-1))
            hits.append((int((drafted == batch.labels)[learn].sum()), count))
        else:
            hits.append((0, 0))
        num_learned = max(num_learned, count)
        # the next step's slot j reads this step's output at j - 1
        shifted = prenorm.view(b, n, -1)
        hidden = torch.cat([torch.zeros_like(shifted[:, :1]), shifted[:, :-1]], dim=1).reshape(b * n, -1)
    return total, hits, num_learned


def train_head(
    head: Eagle3Head, samples: list[Sample], embed: torch.nn.Module, head_rows: torch.Tensor, options: TrainOptions
) -> TrainResult:
    """Train ``head`` in place on ``samples``; a progress bar per epoch where ``options.progress``."""
    from tqdm import tqdm

    device = torch.device(options.device)
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    steps_per_epoch = math.ceil(len(samples) / options.batch_size)
    total_steps = steps_per_epoch * options.epochs
    schedule = warmup_cosine(optimizer, total_steps, warmup_divisor=20)
    result = TrainResult()
    for epoch in range(options.epochs):
        bar = tqdm([[samples[i] for i in group] for group in index_batches(len(samples), options.batch_size, rng)], desc=f"epoch {epoch + 1}/{options.epochs}", disable=not options.progress, file=sys.stderr)
        losses = []
        for group in bar:
            batch = _collate(group, embed, head_rows, device)
            loss, hits, _ = ttt_forward(head, batch, options.ttt_steps)
            if not loss.requires_grad:
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if len(result.first_losses) < 3:
                result.first_losses.append(float(loss.detach()))
            top1 = hits[0][0] / hits[0][1] if hits[0][1] else 0.0
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{top1:.2f}")
        result.epoch_losses.append(sum(losses) / max(1, len(losses)))
    head.eval()
    return result


@torch.no_grad()
def evaluate_head(head: Eagle3Head, samples: list[Sample], embed: torch.nn.Module, head_rows: torch.Tensor, options: TrainOptions) -> Evaluation:
    """Held-out top-1 agreement per drafting step and the loss."""
    device = torch.device(options.device)
    head.eval()
    hits = [[0, 0] for _ in range(options.ttt_steps)]
    loss_sum, batches, positions = 0.0, 0, 0
    for group in [[samples[i] for i in g] for g in index_batches(len(samples), options.batch_size, None)]:
        batch = _collate(group, embed, head_rows, device)
        loss, step_hits, count = ttt_forward(head, batch, options.ttt_steps)
        for s, (hit, total) in enumerate(step_hits):
            hits[s][0] += hit
            hits[s][1] += total
        loss_sum += float(loss)
        batches += 1
        positions += count
    return Evaluation([h / t if t else 0.0 for h, t in hits], loss_sum / max(1, batches), positions)
