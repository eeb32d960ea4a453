"""The DFlash and DSpark proposers: a block-diffusion drafter over the target's hidden states.

``speculative_config={"method": "dflash" | "dspark", "model": FOLDER, "num_speculative_tokens": k}``
(or no method: it is read from the folder's config, see ``sonar.spec_decode.detect``). At
load the target is asked to keep the hidden states of the drafter's ``target_layer_ids``
from its normal forward pass. After every step, per request:

1. the target's states of the positions it computed and kept (a whole prompt after a
   prefill; the last known token and the accepted drafts after a verify step) go once through
   the drafter's ``fc``/``hidden_norm`` and every layer's key/value projections; those keys and
   values stay in the drafter's own paged cache (``PagedDraftCache``);
2. one non-causal pass over the block ``[last token, mask, ...]`` (the target's embeddings), at
   the positions after the context, attends to that cache and to the block itself; the
   target's LM head turns the slots into logits, and the drafts are their argmax, left to right
   through DSpark's Markov head where the checkpoint has one (up to ``k`` of them);
3. DSpark's confidence head gives, per draft, the chance it is accepted given the ones before
   were; their running product goes out as ``DraftTokens.confidence``.

Drafts are greedy (``DraftTokens.probs`` is None): the verifier treats them as one-hot, so
greedy output equals decoding without speculation and sampled output keeps its distribution.
The drafter runs on the target's device. Its cache is paged (``PagedDraftCache``): step 1
writes through slot indices and steps 2 and 3 are one pass that reads through the device
block table; each is a ``DraftPass``, replayed from a graph at a padded size where the platform
captures (step 1 by rows of new states, steps 2 and 3 by drafting requests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from sonar.spec_decode.dflash_checkpoint import load_dflash
from sonar.spec_decode.dflash_config import DFlashConfig, read_dflash_config
from sonar.spec_decode.dflash_model import FUSED_ROTARY_DEVICES, DFlashDrafter
from sonar.spec_decode.draft_graphs import DraftPass, build_context_pass, capture_sizes, slot_buckets
from sonar.spec_decode.eagle3 import target_embedding
from sonar.spec_decode.interface import (
    ChainedDrafts,
    ChainedStep,
    DraftCacheBudget,
    DraftTokens,
    Proposer,
    ProposerInputs,
    SpeculativeConfig,
)
from sonar.spec_decode.paged_draft_cache import STANDALONE_BUDGET, PagedDraftCache, build_draft_cache
from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.worker.model_runner import ModelRunner


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
    keeps_context = True
    chains = True
    drafts_in_passes = True
    method = "dflash"

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.drafter_config = self.check_config(config)
        self.drafter: DFlashDrafter | None = None
        self.embed: torch.nn.Module | None = None
        self.lm_head = None  # the target's compute_logits
        self.cache: PagedDraftCache | None = None
        self.block_pass: DraftPass | None = None
        self.context_pass: DraftPass | None = None
        self.bound = False  # a model runner sizes the cache (init_cache); else load_model does
        self._chained_from: dict[str, int] = {}  # per request of the last chained step: its slots before it
        self._pass_slots = 0  # the most slots a request reads in the passes of its step (begin_passes)

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
        self.dtype = dtype
        if not self.bound:
            self.init_cache(DraftCacheBudget(**STANDALONE_BUDGET))

    def bind_runner(self, runner: ModelRunner) -> None:
        """The runner sizes the drafter's cache from its block budget (``init_cache``)."""
        self.bound = True

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Every draft layer's keys and values (and the positions) of a block of tokens."""
        config = self.drafter_config
        return block_size * PagedDraftCache.bytes_per_slot(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.dtype)

    def init_cache(self, budget: DraftCacheBudget) -> None:
        """Allocate the drafter's paged cache for ``budget`` and capture the block pass at
        padded batch sizes, and the context pass at padded row counts, where
        ``budget.capturer`` is given."""
        config = self.drafter_config
        self.cache = build_draft_cache(budget, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.dtype, self.device)
        rotary = self.drafter.rotary  # a block's last slot lies block_size - 1 past a request's longest context
        rotary.max_position = max(rotary.max_position, self.cache.max_blocks_per_request * self.cache.block_size + config.block_size)
        if torch.device(self.device).type in FUSED_ROTARY_DEVICES:
            # the table is a host-to-device copy: made before any graph is captured, keyed by the
            # device as its tensors name it (with its index)
            rotary.cos_sin_cache(torch.empty(0, device=self.device).device)
        sizes = capture_sizes(budget.max_num_seqs, self.config.max_batch_size)
        inputs = {name: torch.zeros((max(sizes),), dtype=torch.int64, device=self.device) for name in ("rows", "anchors", "anchor_positions")}
        self.block_pass = DraftPass(f"{self.method} block", self._block_pass, inputs, {"rows": self.cache.padding_row})
        self.context_pass, context_rows = build_context_pass(
            f"{self.method} context", self._context_pass, budget.max_num_seqs, self.config.num_speculative_tokens,
            self.drafter.fc.in_features, self.dtype, self.device,
        )  # fmt: skip
        if budget.capturer is not None:
            max_slots = self.cache.max_blocks_per_request * self.cache.block_size
            self.block_pass.capture(budget.capturer, sizes, slot_buckets(self.cache.block_size, max_slots))
            self.context_pass.capture(budget.capturer, context_rows, [0])

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
        cache = self.cache
        positions = inputs.positions.tolist()
        drafting, start = [], 0
        for i, (tokens, count) in enumerate(zip(inputs.token_ids, inputs.num_hidden_states)):
            if count and positions[start + count - 1] == len(tokens) - 2:  # the latest state, with the sampled token after it
                drafting.append(i)
            start += count
        self.keep_context(inputs)  # 1. the target's states: every layer's keys and values, kept
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        confidence: list[list[float] | None] | None = None
        if not drafting:
            return DraftTokens(list(inputs.req_ids), drafts)
        # 2. and 3. one pass over each drafting request's block
        req_ids = [inputs.req_ids[i] for i in drafting]
        columns = [
            [cache.row_of(r) for r in req_ids],
            [inputs.token_ids[i][-1] for i in drafting],
            [len(inputs.token_ids[i]) - 1 for i in drafting],
        ]
        rows, anchors, anchor_positions = to_device(np.asarray(columns, dtype=np.int64), self.device)  # one copy
        values = {"rows": rows, "anchors": anchors, "anchor_positions": anchor_positions}
        tokens, *survival = self.block_pass.run(values, max(cache.lengths.get(r, 0) for r in req_ids))
        rows_survival = survival[0].tolist() if survival else None
        if rows_survival is not None:
            confidence = [None for _ in inputs.req_ids]
        for row, (i, row_tokens) in enumerate(zip(drafting, tokens.tolist())):
            drafts[i] = row_tokens
            if rows_survival is not None:
                confidence[i] = rows_survival[row]
        return DraftTokens(list(inputs.req_ids), drafts, confidence=confidence)

    @torch.inference_mode()
    def propose_chained(self, step: ChainedStep) -> ChainedDrafts:
        """Steps 1 to 3 from a verify step's device results: every verified position's state is
        written to slots claimed for it, then each request's device length is cut to its kept
        positions (the rows after a rejected draft stay unread and are written over next);
        the block's anchor is the token emitted after the last kept draft."""
        cache = self.cache
        before = [cache.lengths.get(r, 0) for r in step.req_ids]
        slots = cache.claim_many(step.req_ids, step.num_positions)
        num_rows = sum(step.num_positions)
        self.context_pass.run({"states": step.hidden_states[:num_rows], "positions": step.positions[:num_rows], "slots": slots})
        columns = [[cache.row_of(r) for r in step.req_ids], [n + 1 for n in before], step.starts, [p + 1 for p in step.first_positions]]
        rows, kept_from, starts, anchor_from = to_device(np.asarray(columns, dtype=np.int64), self.device)  # one copy
        accepted = step.num_accepted
        cache.device_lengths.index_copy_(0, rows, kept_from + accepted)
        values = {"rows": rows, "anchors": step.token_ids[starts + accepted], "anchor_positions": anchor_from + accepted}
        tokens, *survival = self.block_pass.run(values, max(n + count for n, count in zip(before, step.num_positions)))
        self._chained_from = dict(zip(step.req_ids, before))
        return ChainedDrafts(tokens, survival[0] if survival else None)

    def settle_chained(self, req_ids: list[str], num_accepted: list[int]) -> None:
        """Each request's host length: its slots before the step, its last known token and
        its kept drafts."""
        before, self._chained_from = self._chained_from, {}
        for req_id, accepted in zip(req_ids, num_accepted):
            if req_id in before:
                self.cache.settle(req_id, before[req_id] + 1 + accepted)

    def begin_passes(self, req_id: str, num_rows: int) -> bool:
        """Blocks for ``num_rows`` more slots after the request's claimed ones (its first
        pass's), so that every pass can write its kept states through the device table."""
        cache = self.cache
        length = cache.lengths.get(req_id)
        if length is None or req_id not in self._chained_from:
            return False
        try:
            cache.reserve(req_id, length + num_rows)
        except (ValueError, RuntimeError):  # no room for the passes: the step runs one
            return False
        self._pass_slots = length + num_rows
        return True

    @torch.inference_mode()
    def propose_pass(
        self, req_id: str, states: torch.Tensor, positions: torch.Tensor, num_kept: torch.Tensor, anchor: torch.Tensor, anchor_position: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1 to 3 of one request between passes, on the device: the pass's kept states
        written after the request's device length (the rest to the scratch slot), the length
        moved past them, and one block drafted after ``anchor``."""
        cache = self.cache
        row = cache.row_of(req_id)
        rows = torch.full((1,), row, dtype=torch.int64, device=self.device)
        length = cache.device_lengths[row]
        offsets = torch.arange(states.shape[0], device=self.device)
        index = length + offsets
        kept = offsets < num_kept
        slots = torch.where(kept, cache.device_slots(rows.expand_as(index), torch.where(kept, index, 0)), 0)
        self.context_pass.run({"states": states, "positions": positions, "slots": slots})
        cache.device_lengths[row : row + 1].copy_((length + num_kept).view(1))
        values = {"rows": rows, "anchors": anchor.view(1), "anchor_positions": anchor_position.view(1)}
        tokens, *survival = self.block_pass.run(values, self._pass_slots)
        return tokens[0], survival[0][0] if survival else None

    @torch.inference_mode()
    def keep_context(self, inputs: ProposerInputs) -> None:
        """Every draft layer's keys and values of the target's new states, appended to each
        request's context (no host wait: the counts are the host's, the rest stays on the device)."""
        if inputs.hidden_states is None or inputs.num_hidden_states is None:
            raise RuntimeError(f"the {self.method} proposer needs the target's hidden states (the runner passes them when needs_hidden_states)")
        slots = self.cache.claim_many(list(inputs.req_ids), list(inputs.num_hidden_states))
        if slots is not None:
            self.context_pass.run({"states": inputs.hidden_states, "positions": inputs.positions, "slots": slots})

    def _context_pass(self, inputs: dict[str, torch.Tensor], num_slots: int) -> tuple[torch.Tensor, ...]:
        """Every draft layer's keys and values of the target's states ``inputs["states"]`` at
        ``inputs["positions"]``, written to the cache's ``inputs["slots"]`` (device values only:
        graph-safe; padding rows write the scratch block)."""
        context = self.drafter.context(inputs["states"], inputs["positions"])
        self.cache.write_slots(inputs["slots"], context, inputs["positions"])
        return ()

    def _block_pass(self, inputs: dict[str, torch.Tensor], num_slots: int) -> tuple[torch.Tensor, ...]:
        """The drafts ``[R, k]`` (and DSpark's survival estimates ``[R, k]``) of one block per
        row ``inputs["rows"]``, reading ``num_slots`` context slots of each (device values
        only: graph-safe)."""
        drafter, cache, config = self.drafter, self.cache, self.drafter_config
        rows, anchors = inputs["rows"], inputs["anchors"]
        block = config.block_size
        masked = torch.full((rows.shape[0], block - 1), config.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids = torch.cat([anchors[:, None], masked], dim=1)
        block_positions = inputs["anchor_positions"][:, None] + torch.arange(block, device=anchors.device)[None, :]  # [R, B]
        valid = torch.arange(num_slots, device=anchors.device)[None, :] < cache.device_lengths[rows][:, None]
        masks = self._masks(block_positions, cache.read_positions(rows, num_slots), valid)
        hidden = drafter.block(self.embed(ids), block_positions, cache.layers(rows, num_slots), masks)
        k = self.config.num_speculative_tokens
        slots = hidden[:, config.first_slot : config.first_slot + k]  # [R, k, hidden]
        base = self.lm_head(slots.reshape(-1, slots.shape[-1])).view(rows.shape[0], k, -1)
        tokens, prev = drafter.pick_greedy(base, slots, anchors)
        logits = drafter.confidence_logits(slots, prev)
        if logits is None:
            return (tokens,)
        return tokens, torch.sigmoid(logits.float()).cumprod(dim=-1)

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
