"""Training a DFlash or DSpark drafter on the target's own states and greedy tokens.

The data are the EAGLE-3 trainer's (``sonar.spec_decode.eagle3_data``): per sequence (prompt and
the target's answer) the target's hidden states of the drafter's layers and its final states.
Each step samples up to ``num_anchors`` anchors per sequence among its answer tokens; anchor
``a`` makes a block ``[token a, mask, ...]`` at positions ``a ..`` that attends, as drafting
does, to the context before ``a`` and to its own block (all blocks of a sequence in one pass).
Slot ``j`` learns the target's greedy token at ``a + j + slot_offset`` by cross-entropy,
weighted ``exp(-j / loss_decay_gamma)`` as DeepSpec does; DSpark's Markov head reads the known
token before each slot (teacher forcing). The confidence head learns, by binary
cross-entropy, whether each slot's argmax draft is the target's greedy token: the drafter's
own acceptance outcome given the drafts before it were accepted, so the running product of
its sigmoids estimates the chance a prefix survives greedy verification.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from sonar.spec_decode.dflash_config import DFlashConfig
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.eagle3_data import Sample
from sonar.spec_decode.train_schedule import index_batches, warmup_cosine


@dataclass(slots=True)
class DFlashTrainOptions:
    """``epochs`` over the samples in batches of ``batch_size`` sequences, AdamW at ``lr``
    (warm-up, cosine decay), ``num_anchors`` blocks per sequence and step."""

    epochs: int = 2
    lr: float = 6e-4
    batch_size: int = 8
    num_anchors: int = 64
    loss_decay_gamma: float = 4.0
    confidence_weight: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.num_anchors < 1:
            raise ValueError("epochs, batch_size and num_anchors must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass(slots=True)
class DFlashEvaluation:
    """Held-out figures over the sampled blocks: per draft position the rate its greedy draft
    is the target's token given the earlier ones were (``top1``), the mean acceptance length
    of a block (1 + its accepted prefix, greedy verification), and where there is a confidence
    head the mean predicted and observed survival of each prefix."""

    top1: list[float]
    acceptance_length: float
    loss: float
    num_blocks: int
    predicted_survival: list[float] | None = None
    observed_survival: list[float] | None = None


@dataclass(slots=True)
class DFlashTrainResult:
    epoch_losses: list[float] = field(default_factory=list)


def drafter_config_for(
    target_config: object,
    layout: str,
    block_size: int,
    num_draft_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    markov_rank: int = 0,
    markov_head_type: str | None = None,
    confidence_head: bool = False,
    num_anchors: int = 512,
) -> DFlashConfig:
    """A drafter whose layers are shaped like the target's (``target_config``: its transformers config)."""
    heads = target_config.num_attention_heads
    hidden = target_config.hidden_size
    return DFlashConfig(
        layout=layout,
        hidden_size=hidden,
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        intermediate_size=target_config.intermediate_size,
        vocab_size=target_config.vocab_size,
        block_size=block_size,
        target_layer_ids=tuple(target_layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=target_config.num_hidden_layers,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(target_config, "rope_theta", None) or 10000.0),
        rope_scaling=getattr(target_config, "rope_scaling", None),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", None) or 2048),
        markov_rank=markov_rank,
        markov_head_type=markov_head_type if markov_rank else None,
        enable_confidence_head=confidence_head,
        confidence_head_with_markov=confidence_head and markov_rank > 0,
        num_anchors=num_anchors,
    )


def init_drafter(drafter: DFlashDrafter, std: float = 0.02, seed: int = 0) -> DFlashDrafter:
    """Normal(0, ``std``) linear and embedding weights, zero biases, unit norms; the Markov
    head's output starts at zero (the drafter starts as plain DFlash)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.zero_()
    return drafter


@torch.no_grad()
def target_greedy_ids(samples: list[Sample], head_weight: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Per sample, the target's argmax next token at every position ``[T]`` (its final
    states through its LM head ``head_weight [vocab, hidden]``)."""
    weight = head_weight.to(device)
    return [(s.final_states.to(device, weight.dtype) @ weight.T).argmax(dim=-1).cpu() for s in samples]


@dataclass(slots=True)
class _Batch:
    aux: torch.Tensor  # [S, T, A] the target's states
    ctx_positions: torch.Tensor  # [S, T]
    block_ids: torch.Tensor  # [S, N * B] anchor then masks, per block
    block_positions: torch.Tensor  # [S, N * B]
    mask: torch.Tensor  # [S, 1, N * B, T + N * B]
    labels: torch.Tensor  # [S, N, n] the target's greedy token per draft slot, -1 where none
    prev_ids: torch.Tensor  # [S, N, n] the known token before each draft slot
    weights: torch.Tensor  # [S, N, n] loss weights (0 where no label)


def _collate(
    samples: list[Sample], greedy: list[torch.Tensor], config: DFlashConfig, num_anchors: int, gen: torch.Generator, device: torch.device
) -> _Batch | None:
    block, first, offset = config.block_size, config.first_slot, config.slot_offset
    n = block - first
    t = max(len(s.token_ids) for s in samples)
    anchors_per = []
    for s in samples:
        valid = torch.arange(s.num_prompt_tokens, len(s.token_ids) - 1)  # answer tokens with a token after them
        if len(valid) > num_anchors:
            valid = valid[torch.randperm(len(valid), generator=gen)[:num_anchors]].sort().values
        anchors_per.append(valid)
    num_blocks = max(len(a) for a in anchors_per)
    if num_blocks == 0:
        return None
    size = len(samples)
    width = samples[0].aux_states.shape[-1]
    aux = torch.zeros(size, t, width)
    block_ids = torch.full((size, num_blocks, block), config.mask_token_id, dtype=torch.int64)
    block_positions = torch.zeros(size, num_blocks, block, dtype=torch.int64)
    labels = torch.full((size, num_blocks, n), -1, dtype=torch.int64)
    prev_ids = torch.zeros(size, num_blocks, n, dtype=torch.int64)
    ctx_visible = torch.zeros(size, num_blocks, t, dtype=torch.bool)
    block_real = torch.zeros(size, num_blocks, dtype=torch.bool)
    slots = torch.arange(first, block)
    for i, (s, anchors) in enumerate(zip(samples, anchors_per)):
        length = len(s.token_ids)
        tokens = torch.tensor(s.token_ids, dtype=torch.int64)
        aux[i, :length] = s.aux_states.float()
        count = len(anchors)
        block_real[i, :count] = True
        block_ids[i, :count, 0] = tokens[anchors]
        block_positions[i, :count] = anchors[:, None] + torch.arange(block)[None, :]
        targets = anchors[:, None] + slots[None, :] + offset  # [count, n] the positions drafted
        safe = targets.clamp(max=length - 1)
        # a slot's label is the target's argmax after the tokens before it; drafting, those are
        # the anchor and the greedy chain after it, so a slot counts only while the answer's
        # own tokens between the anchor and it are that chain (always, in a greedy answer;
        # not after a sampled token that differs)
        off_chain = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), (tokens[1:] != greedy[i][:-1]).long()]), 0)
        on_chain = off_chain[safe - 1] == off_chain[anchors][:, None]
        labels[i, :count] = torch.where((targets < length) & on_chain, greedy[i][safe - 1], -1)
        prev_ids[i, :count] = tokens[safe - 1]
        ctx_visible[i, :count] = torch.arange(t)[None, :] < anchors[:, None]
    weights = (labels >= 0).float()
    # every query of block m sees the context before its anchor and the keys of block m
    q = num_blocks * block
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * num_blocks)  # [Q, Q]
    ctx = ctx_visible[:, :, None, :].expand(size, num_blocks, block, t).reshape(size, q, t)
    keep = block_real[:, :, None].expand(size, num_blocks, block).reshape(size, q, 1)
    mask = torch.cat([ctx & keep, own[None].expand(size, q, q)], dim=-1)[:, None]
    return _Batch(
        aux.to(device), torch.arange(t).expand(size, t).to(device), block_ids.view(size, q).to(device),
        block_positions.view(size, q).to(device), mask.to(device), labels.to(device), prev_ids.to(device), weights.to(device),
    )  # fmt: skip


def _forward(
    drafter: DFlashDrafter, batch: _Batch, embed: torch.nn.Module, head_weight: torch.Tensor, options: DFlashTrainOptions
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's loss and, detached, per slot hits, weights and confidence."""
    config = drafter.config
    size, num_blocks, n = batch.labels.shape
    context = drafter.context(batch.aux, batch.ctx_positions)
    hidden = drafter.block(embed(batch.block_ids), batch.block_positions, context, [batch.mask] * config.num_hidden_layers)
    slots = hidden.view(size, num_blocks, config.block_size, -1)[:, :, config.first_slot :]  # [S, N, n, hidden]
    logits = drafter.teacher_forced_logits(slots, head_weight, batch.prev_ids)
    decay = torch.exp(-torch.arange(n, device=logits.device, dtype=torch.float32) / options.loss_decay_gamma)
    weights = batch.weights * decay
    labels = batch.labels.clamp(min=0)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(weights)
    total = weights.sum().clamp(min=1e-6)
    loss = (ce * weights).sum() / total
    hits = (logits.argmax(dim=-1) == batch.labels).float()
    conf = drafter.confidence_logits(slots, batch.prev_ids)
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, hits, reduction="none")
        loss = loss + options.confidence_weight * (bce * weights).sum() / total
    details = {"hits": hits.detach(), "valid": batch.weights.detach(), "confidence": None if conf is None else conf.detach()}
    return loss, details


def _autocast(device: torch.device):
    """bfloat16 autocast on CUDA, and on a CPU whose matrix units take bfloat16 natively
    (AMX or AVX-512 BF16: the vocabulary-wide products run about 4x faster there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and _cpu_has_native_bfloat16():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _cpu_has_native_bfloat16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def train_drafter(
    drafter: DFlashDrafter,
    samples: list[Sample],
    greedy: list[torch.Tensor],
    embed: torch.nn.Module,
    head_weight: torch.Tensor,
    options: DFlashTrainOptions,
) -> DFlashTrainResult:
    """Train ``drafter`` in place (on ``options.device``); ``greedy[i]`` is sample ``i``'s
    target argmax per position, ``head_weight [vocab, hidden]`` the target's LM head (frozen)."""
    from tqdm import tqdm

    device = torch.device(options.device)
    rng = random.Random(options.seed)
    gen = torch.Generator().manual_seed(options.seed)
    torch.manual_seed(options.seed)
    drafter.train()
    head_weight = head_weight.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    steps_per_epoch = math.ceil(len(samples) / options.batch_size)
    total_steps = steps_per_epoch * options.epochs
    schedule = warmup_cosine(optimizer, total_steps, warmup_divisor=25)
    result = DFlashTrainResult()
    for epoch in range(options.epochs):
        groups = index_batches(len(samples), options.batch_size, rng)
        bar = tqdm(groups, desc=f"epoch {epoch + 1}/{options.epochs}", disable=not options.progress, file=sys.stderr)
        losses = []
        for group in bar:
            batch = _collate([samples[i] for i in group], [greedy[i] for i in group], drafter.config, options.num_anchors, gen, device)
            if batch is None:
                continue
            with _autocast(device):
                loss, details = _forward(drafter, batch, embed, head_weight, options)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            valid = details["valid"]
            top1 = float((details["hits"] * valid).sum() / valid.sum().clamp(min=1))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{top1:.2f}")
        result.epoch_losses.append(sum(losses) / max(1, len(losses)))
    drafter.eval()
    return result


@torch.no_grad()
def evaluate_drafter(
    drafter: DFlashDrafter,
    samples: list[Sample],
    greedy: list[torch.Tensor],
    embed: torch.nn.Module,
    head_weight: torch.Tensor,
    options: DFlashTrainOptions,
) -> DFlashEvaluation:
    """Held-out figures (see ``DFlashEvaluation``); the anchors are drawn from a fixed seed."""
    device = torch.device(options.device)
    drafter.eval()
    gen = torch.Generator().manual_seed(options.seed + 1)
    head_weight = head_weight.to(device)
    n = drafter.config.block_size - drafter.config.first_slot
    hit_sum, cond_count = torch.zeros(n), torch.zeros(n)
    accepted_sum, num_blocks, loss_sum, num_batches = 0.0, 0, 0.0, 0
    predicted, observed, counted = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for group in index_batches(len(samples), options.batch_size, None):
        batch = _collate([samples[i] for i in group], [greedy[i] for i in group], drafter.config, options.num_anchors, gen, device)
        if batch is None:
            continue
        with _autocast(device):
            loss, details = _forward(drafter, batch, embed, head_weight, options)
        loss_sum += float(loss)
        num_batches += 1
        hits, valid = details["hits"].cpu(), details["valid"].cpu()  # [S, N, n]
        prefix = torch.cumprod(hits * valid, dim=-1)  # drafts 0..j all accepted
        before = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], dim=-1) * valid  # 0..j-1 accepted, j drafted
        hit_sum += (hits * before).sum(dim=(0, 1))
        cond_count += before.sum(dim=(0, 1))
        real = valid[..., 0] > 0
        accepted_sum += float(prefix.sum(-1)[real].sum())
        num_blocks += int(real.sum())
        if details["confidence"] is not None:
            survival = torch.sigmoid(details["confidence"].float().cpu()).cumprod(dim=-1)
            predicted += (survival * valid).sum(dim=(0, 1))
            observed += (prefix * valid).sum(dim=(0, 1))
            counted += valid.sum(dim=(0, 1))
    has_confidence = drafter.confidence_head is not None
    return DFlashEvaluation(
        top1=(hit_sum / cond_count.clamp(min=1)).tolist(),
        acceptance_length=1.0 + accepted_sum / max(1, num_blocks),
        loss=loss_sum / max(1, num_batches),
        num_blocks=num_blocks,
        predicted_survival=(predicted / counted.clamp(min=1)).tolist() if has_confidence else None,
        observed_survival=(observed / counted.clamp(min=1)).tolist() if has_confidence else None,
    )
