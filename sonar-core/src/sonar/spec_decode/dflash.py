"""The DFlash and DSpark proposers: a block-diffusion drafter over the target's hidden states.

``speculative_config={"method": "dflash" | "dspark", "model": FOLDER, "num_speculative_tokens": k}``
(or no method: it is read from the folder's config, see ``sonar.spec_decode.detect``). At
load the target is asked to keep the hidden states of the drafter's ``target_layer_ids``
from its normal forward pass. After every step, per request:

1. the target's states of the positions it computed and kept (a whole prompt after a
   prefill; the last known token and the accepted drafts after a verify step) go once through
   the drafter's ``fc``/``hidden_norm`` and every layer's key/value projections; those keys and
   values stay in the drafter's own cache (``ContextKVCache``);
2. one non-causal pass over the block ``[last token, mask, ...]`` (the target's embeddings), at
   the positions after the context, attends to that cache and to the block itself; the
   target's LM head turns the slots into logits, and the drafts are their argmax, left to right
   through DSpark's Markov head where the checkpoint has one (up to ``k`` of them);
3. DSpark's confidence head gives, per draft, the chance it is accepted given the ones before
   were; their running product goes out as ``DraftTokens.confidence``.

Drafts are greedy (``DraftTokens.probs`` is None): the verifier treats them as one-hot, so
greedy output equals decoding without speculation and sampled output keeps its distribution.
The drafter runs eagerly on the target's device.
"""

from __future__ import annotations

import torch

from sonar.spec_decode.dflash_cache import ContextKVCache
from sonar.spec_decode.dflash_checkpoint import load_dflash
from sonar.spec_decode.dflash_config import DFlashConfig, read_dflash_config
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.eagle3 import target_embedding
from sonar.spec_decode.interface import DraftTokens, Proposer, ProposerInputs, SpeculativeConfig


def check_against_target(config: DFlashConfig, target_config: object, num_target_layers: int, folder: str) -> None:
    """Refuse a drafter built for another target (its width, vocabulary or depth).

    :raises ValueError: the field that differs, with both values.
    """
    hidden = getattr(target_config, "hidden_size", config.hidden_size)
    vocab = getattr(target_config, "vocab_size", config.vocab_size)
    if hidden != config.hidden_size:
        raise ValueError(f"drafter {folder!r}: hidden_size {config.hidden_size} differs from the target's {hidden} (it shares the target's embedding and LM head)")
    if vocab != config.vocab_size:
        raise ValueError(f"drafter {folder!r}: vocab_size {config.vocab_size} differs from the target's {vocab}")
    if config.num_target_layers is not None and config.num_target_layers != num_target_layers:
        raise ValueError(f"drafter {folder!r}: num_target_layers {config.num_target_layers} differs from the target's {num_target_layers} layers")
    if config.target_layer_ids[-1] >= num_target_layers - 1:
        raise ValueError(
            f"drafter {folder!r}: target_layer_ids {list(config.target_layer_ids)} read the last layer's output; "
            f"Sonar reads layer outputs up to layer {num_target_layers - 2} of this {num_target_layers}-layer target"
        )


class DFlashProposer(Proposer):
    """Drafts a block per request with a DFlash drafter (a DSpark one's heads included)."""

    needs_hidden_states = True
    method = "dflash"

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.drafter_config = self.check_config(config)
        self.drafter: DFlashDrafter | None = None
        self.embed: torch.nn.Module | None = None
        self.lm_head = None  # the target's compute_logits
        self.cache: ContextKVCache | None = None

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> DFlashConfig:
        """``model`` must name a drafter folder whose blocks hold ``num_speculative_tokens``."""
        if not config.model:
            raise ValueError(f'speculative_config: method "{cls.method}" needs "model", the folder of a {cls.method} drafter')
        drafter = read_dflash_config(config.model)
        cls._check_kind(drafter, config.model)
        if config.num_speculative_tokens > drafter.num_drafts:
            raise ValueError(
                f"speculative_config: num_speculative_tokens={config.num_speculative_tokens} exceeds the {drafter.num_drafts} "
                f"drafts a block of the drafter holds (block_size {drafter.block_size}, {drafter.layout} layout)"
            )
        return drafter

    @classmethod
    def _check_kind(cls, drafter: DFlashConfig, folder: str) -> None:
        """Any DFlash or DSpark checkpoint runs as ``dflash`` (a DSpark one with its heads)."""

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the drafter in the target's dtype, share the target's embedding and LM head,
        and have the target keep the drafter's layers."""
        embed = target_embedding(target_model)
        weight = getattr(embed, "weight", None)
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
        aux = getattr(target_model, "aux_hidden_states", None)
        if aux is None:
            raise ValueError(f"{type(target_model).__name__} cannot expose the hidden states a {self.method} drafter reads")
        config = self.drafter_config
        check_against_target(config, getattr(target_model, "config", None), aux.num_layers, self.config.model)
        self.drafter = load_dflash(self.config.model, dtype, self.device)
        aux.select(config.aux_layer_ids)
        self.embed = embed
        self.lm_head = target_model.compute_logits
        self.cache = ContextKVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype, self.device)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Forget the drafter's context of these requests."""
        if self.cache is not None:
            for req_id in req_ids:
                self.cache.remove(req_id)

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Up to ``num_speculative_tokens`` greedy drafts per request (none for a request whose
        latest target state did not arrive), with DSpark's survival estimates where it has them."""
        if inputs.hidden_states is None or inputs.num_hidden_states is None:
            raise RuntimeError(f"the {self.method} proposer needs the target's hidden states (the runner passes them when needs_hidden_states)")
        drafter, cache, config = self.drafter, self.cache, self.drafter_config
        positions = inputs.positions.tolist()
        drafting, start = [], 0
        for i, (tokens, count) in enumerate(zip(inputs.token_ids, inputs.num_hidden_states)):
            if count and positions[start + count - 1] == len(tokens) - 2:  # the latest state, with the sampled token after it
                drafting.append(i)
            start += count
        # 1. the target's states: every layer's keys and values, kept
        if inputs.hidden_states.shape[0]:
            context = drafter.context(inputs.hidden_states, inputs.positions)
            start = 0
            for req_id, count in zip(inputs.req_ids, inputs.num_hidden_states):
                if count:
                    rows = slice(start, start + count)
                    cache.append(req_id, [(k[rows], v[rows]) for k, v in context], inputs.positions[rows])
                start += count
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        confidence: list[list[float] | None] | None = None
        if not drafting:
            return DraftTokens(list(inputs.req_ids), drafts)
        # 2. one pass over each drafting request's block
        req_ids = [inputs.req_ids[i] for i in drafting]
        device = self.device
        block = config.block_size
        anchors = torch.tensor([inputs.token_ids[i][-1] for i in drafting], dtype=torch.int64, device=device)
        anchor_positions = torch.tensor([len(inputs.token_ids[i]) - 1 for i in drafting], dtype=torch.int64, device=device)
        ids = torch.full((len(drafting), block), config.mask_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = anchors
        block_positions = anchor_positions[:, None] + torch.arange(block, device=device)[None, :]  # [R, B]
        ctx, ctx_positions, valid = cache.gather(req_ids)
        masks = self._masks(block_positions, ctx_positions, valid)
        hidden = drafter.block(self.embed(ids), block_positions, ctx, masks)
        k = self.config.num_speculative_tokens
        slots = hidden[:, config.first_slot : config.first_slot + k]  # [R, k, hidden]
        base = self.lm_head(slots.reshape(-1, slots.shape[-1])).view(len(drafting), k, -1)
        tokens, prev = drafter.pick_greedy(base, slots, anchors)
        # 3. DSpark: the chance each prefix survives
        logits = drafter.confidence_logits(slots, prev)
        survival = None if logits is None else torch.sigmoid(logits.float()).cumprod(dim=-1).tolist()
        if survival is not None:
            confidence = [None for _ in inputs.req_ids]
        for row, (i, row_tokens) in enumerate(zip(drafting, tokens.tolist())):
            drafts[i] = row_tokens
            if survival is not None:
                confidence[i] = survival[row]
        return DraftTokens(list(inputs.req_ids), drafts, confidence=confidence)

    def _masks(self, block_positions: torch.Tensor, ctx_positions: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
        """Per draft layer ``[R, 1, B, L + B]``: every slot sees the real context and its whole
        block (a sliding layer only the context inside its window)."""
        r, b = block_positions.shape
        own = torch.ones(r, b, b, dtype=torch.bool, device=valid.device)
        full = torch.cat([valid[:, None, :].expand(r, b, -1), own], dim=-1)[:, None]
        masks = []
        for layer in range(self.drafter_config.num_hidden_layers):
            window = self.drafter_config.window_of(layer)
            if window is None:
                masks.append(full)
                continue
            near = block_positions[:, :, None] - ctx_positions[:, None, :] < window
            masks.append(torch.cat([valid[:, None, :] & near, own], dim=-1)[:, None])
        return masks


class DSparkProposer(DFlashProposer):
    """Drafts with a DSpark drafter: DFlash's block plus its Markov and confidence heads."""

    method = "dspark"

    @classmethod
    def _check_kind(cls, drafter: DFlashConfig, folder: str) -> None:
        """Refuse a checkpoint without DSpark's heads."""
        if not drafter.is_dspark:
            raise ValueError(
                f"drafter {folder!r} is a DFlash drafter ({drafter.layout} layout, markov_rank 0, no confidence head): "
                'use method "dflash" (method "dspark" needs a DeepSpec dspark checkpoint)'
            )
