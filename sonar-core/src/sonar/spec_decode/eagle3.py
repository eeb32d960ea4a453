"""The EAGLE-3 proposer: a one-layer draft head reading the target's auxiliary hidden states.

``speculative_config={"method": "eagle3", "model": HEAD_FOLDER, "num_speculative_tokens": k}``.
At load the target is asked to keep the inputs of three of its decoder layers (the head's
``eagle_aux_hidden_state_layer_ids``, else ``(2, L // 2, L - 3)``) from its normal forward
pass. After every step, per request:

1. the target's states of the positions it computed and kept (a whole prompt after a
   prefill; the last known token and the accepted drafts after a verify step) go through the
   head's fc and, paired with the embedding of the token after each, into the draft layer;
   their keys and values stay in the head's own cache;
2. the last slot's output gives the first draft (draft-vocabulary argmax, mapped to a target
   id through ``d2t``); the head's own output state and that draft's embedding make the next
   slot, and so on for ``k`` drafts;
3. the slots of step 2 are dropped from the head's cache (the next step rewrites those
   positions from the target's verified states).

Drafts are greedy (``DraftTokens.probs`` is None): the verifier treats them as one-hot, so
greedy output equals decoding without speculation and sampled output keeps its distribution.

The head's cache is paged (``PagedDraftCache``): step 1 writes the verified slots through
slot indices; steps 2 and 3 are one pass over the drafting requests (``DraftPass``) that
reads through the device block table and writes its guessed slots at device-computed slots,
so on a platform that captures graphs it is replayed at a padded batch size. Dropping the
guesses is then nothing more than not committing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sonar.spec_decode.draft_graphs import DraftPass, build_context_pass, capture_sizes, slot_buckets
from sonar.spec_decode.eagle3_checkpoint import load_eagle3, read_eagle3_config
from sonar.spec_decode.eagle3_head import Eagle3Head
from sonar.spec_decode.interface import DraftCacheBudget, DraftTokens, Proposer, ProposerInputs, SpeculativeConfig
from sonar.spec_decode.paged_draft_cache import STANDALONE_BUDGET, PagedDraftCache, build_draft_cache
from sonar.tensors import to_device

if TYPE_CHECKING:
    from sonar.worker.model_runner import ModelRunner


def target_embedding(target_model: torch.nn.Module) -> torch.nn.Module:
    """The target's token embedding (the module named ``embed_tokens``)."""
    for name, module in target_model.named_modules():
        if name.split(".")[-1] == "embed_tokens":
            return module
    raise ValueError(f"{type(target_model).__name__} has no embed_tokens module to lend an EAGLE-3 head")


class Eagle3Proposer(Proposer):
    """Drafts with an EAGLE-3 head over the target's auxiliary hidden states."""

    needs_hidden_states = True
    keeps_context = True

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.check_config(config)
        self.head: Eagle3Head | None = None
        self.embed: torch.nn.Module | None = None
        self.cache: PagedDraftCache | None = None
        self.draft_pass: DraftPass | None = None
        self.context_pass: DraftPass | None = None
        self.bound = False  # a model runner sizes the cache (init_cache); else load_model does

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """``model`` must name an EAGLE-3 checkpoint folder."""
        if not config.model:
            raise ValueError('speculative_config: method "eagle3" needs "model", the folder of an EAGLE-3 head')
        read_eagle3_config(config.model)

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the head in the target's dtype, share the target's embedding unless the
        checkpoint has its own, and have the target keep the head's auxiliary layers."""
        embed = target_embedding(target_model)
        dtype = embed.weight.dtype if hasattr(embed, "weight") and embed.weight.is_floating_point() else torch.float32
        head, own_embedding = load_eagle3(self.config.model, dtype, self.device)
        self.head = head.eval()
        self.embed = embed if own_embedding is None else torch.nn.Embedding.from_pretrained(own_embedding)
        config = head.config
        aux = getattr(target_model, "aux_hidden_states", None)
        if aux is None:
            raise ValueError(f"{type(target_model).__name__} cannot expose auxiliary hidden states for an EAGLE-3 head")
        ids = list(config.aux_layer_ids) if config.aux_layer_ids is not None else list(aux.default_layer_ids())
        if len(ids) != config.num_aux_layers:
            raise ValueError(f"EAGLE-3 head reads {config.num_aux_layers} auxiliary states, the layer ids are {ids}")
        aux.select(ids)
        target_hidden = getattr(getattr(target_model, "config", None), "hidden_size", config.target_hidden_size)
        if target_hidden != config.target_hidden_size:
            raise ValueError(f"EAGLE-3 head expects target_hidden_size {config.target_hidden_size}, the target's is {target_hidden}")
        self.dtype = dtype
        if not self.bound:
            self.init_cache(DraftCacheBudget(**STANDALONE_BUDGET))

    def bind_runner(self, runner: ModelRunner) -> None:
        """The runner sizes the head's cache from its block budget (``init_cache``)."""
        self.bound = True

    def cache_bytes_per_block(self, block_size: int) -> int:
        """The head's keys and values (one layer) of a block of tokens."""
        config = self.head.config
        return block_size * PagedDraftCache.bytes_per_slot(1, config.num_key_value_heads, config.head_dim, self.dtype)

    def init_cache(self, budget: DraftCacheBudget) -> None:
        """Allocate the head's paged cache for ``budget`` and capture the drafting pass at
        padded batch sizes where ``budget.capturer`` is given."""
        config, k = self.head.config, self.config.num_speculative_tokens
        self.cache = build_draft_cache(budget, 1, config.num_key_value_heads, config.head_dim, self.dtype, self.device, k - 1)
        sizes = capture_sizes(budget.max_num_seqs, self.config.max_batch_size)
        rows = max(sizes)
        inputs = {
            "rows": torch.full((rows,), self.cache.padding_row, dtype=torch.int64, device=self.device),
            "queries": torch.zeros((rows, config.num_attention_heads, config.head_dim), dtype=self.dtype, device=self.device),
            "residual": torch.zeros((rows, config.hidden_size), dtype=self.dtype, device=self.device),
            "positions": torch.zeros((rows,), dtype=torch.int64, device=self.device),
        }
        self.draft_pass = DraftPass("EAGLE-3 drafting", self._draft, inputs, {"rows": self.cache.padding_row}, extra_slots=k - 1)
        self.context_pass, context_rows = build_context_pass(
            "EAGLE-3 context", self._context_pass, budget.max_num_seqs, k, self.head.fc.in_features, self.dtype, self.device, ("next_ids",)
        )
        if budget.capturer is not None:
            max_slots = self.cache.max_blocks_per_request * self.cache.block_size
            self.draft_pass.capture(budget.capturer, sizes, slot_buckets(self.cache.block_size, max_slots))
            self.context_pass.capture(budget.capturer, context_rows, [0])

    def remove_requests(self, req_ids: set[str]) -> None:
        """Forget the head's cache of these requests."""
        if self.cache is not None:
            for req_id in req_ids:
                self.cache.remove(req_id)

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Up to ``num_speculative_tokens`` greedy drafts per request (none for a request
        whose latest target state did not arrive)."""
        if inputs.hidden_states is None or inputs.num_hidden_states is None:
            raise RuntimeError("the EAGLE-3 proposer needs the target's hidden states (the runner passes them when needs_hidden_states)")
        cache = self.cache
        positions = inputs.positions.tolist()
        spans, next_ids, start = [], [], 0
        for tokens, count in zip(inputs.token_ids, inputs.num_hidden_states):
            rows = positions[start : start + count]
            ready = count > 0 and rows[-1] == len(tokens) - 2  # the latest state, with the sampled token after it
            spans.append((start, count, ready))
            next_ids += [tokens[p + 1] if p + 1 < len(tokens) else 0 for p in rows]
            start += count
        drafting = [i for i, (_, _, ready) in enumerate(spans) if ready]
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        if inputs.hidden_states.shape[0]:  # 1. the target's states: every slot's keys and values kept
            q, residual = self._append(inputs, next_ids)
        if not drafting:
            return DraftTokens(list(inputs.req_ids), drafts)
        device = inputs.hidden_states.device
        req_ids = [inputs.req_ids[i] for i in drafting]
        last = torch.tensor([spans[i][0] + spans[i][1] - 1 for i in drafting], dtype=torch.int64, device=device)
        # 2. and 3. one pass: the last slot attended, then the head's own slots, uncommitted
        guesses = self.config.num_speculative_tokens - 1
        cache.reserve_many([(req_id, cache.committed[req_id] + guesses) for req_id in req_ids])
        rows = to_device(torch.tensor([cache.row_of(r) for r in req_ids], dtype=torch.int64), self.device)
        values = {"rows": rows, "queries": q[last], "residual": residual[last], "positions": inputs.positions[last].to(self.device)}
        (proposed,) = self.draft_pass.run(values, max(cache.committed[r] for r in req_ids))
        for i, tokens in zip(drafting, proposed.tolist()):
            drafts[i] = tokens
        return DraftTokens(list(inputs.req_ids), drafts)

    @torch.inference_mode()
    def keep_context(self, inputs: ProposerInputs) -> None:
        """The head's keys and values of the target's new states, appended to each request's
        context. Each request's states are its latest positions, up to the one before its
        last token (every state reaches the proposer once, in order), so the token after each
        is read from the host's sequence, with no wait for the device."""
        if inputs.hidden_states is None or inputs.num_hidden_states is None:
            raise RuntimeError("the EAGLE-3 proposer needs the target's hidden states (the runner passes them when needs_hidden_states)")
        next_ids: list[int] = []
        for tokens, count in zip(inputs.token_ids, inputs.num_hidden_states):
            next_ids += tokens[len(tokens) - count : len(tokens)] if count else []
        if next_ids:
            self._append(inputs, next_ids)

    def _append(self, inputs: ProposerInputs, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Project every new state (with the embedding of the token after it, ``next_ids``)
        and commit its keys and values to its request's context; the queries and residuals
        of all rows are returned for the drafting pass (valid until the next append)."""
        slots = self.cache.claim_many(list(inputs.req_ids), list(inputs.num_hidden_states))
        values = {
            "states": inputs.hidden_states,
            "next_ids": to_device(torch.tensor(next_ids, dtype=torch.int64), self.device),
            "positions": inputs.positions,
            "slots": slots,
        }
        return self.context_pass.run(values)

    def _context_pass(self, inputs: dict[str, torch.Tensor], num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's keys and values of the states ``inputs["states"]`` (each with the
        embedding of ``inputs["next_ids"]``) at ``inputs["positions"]``, written to the cache's
        ``inputs["slots"]``; returns every row's query and residual (device values only:
        graph-safe; padding rows write the scratch block)."""
        head = self.head
        q, k, v, residual = head.project(head.combine(inputs["states"]), self.embed(inputs["next_ids"]), inputs["positions"])
        self.cache.write_slots(inputs["slots"], [(k, v)])
        return q, residual

    def _draft(self, inputs: dict[str, torch.Tensor], num_slots: int) -> tuple[torch.Tensor]:
        """The drafts ``[R, k]`` of rows ``inputs["rows"]`` of the cache: the last verified
        slot's query and residual first, then ``k - 1`` slots of the head's own states,
        written after each row's committed slots (device values only: graph-safe). The first
        attention reads ``num_slots`` slots, the ``j``-th one ``num_slots + j``."""
        head, cache = self.head, self.cache
        rows, positions = inputs["rows"], inputs["positions"]
        seen, scale = cache.device_lengths[rows], head.config.head_dim**-0.5
        normed, state = head.finish(cache.attend(0, rows, inputs["queries"], seen, num_slots, scale), inputs["residual"])
        token = head.to_target_ids(head.logits(normed).argmax(dim=-1))
        proposed = [token]
        for j in range(1, self.config.num_speculative_tokens):
            q, k, v, residual = head.project(state, self.embed(token), positions + j)
            cache.write_rows(0, rows, seen + (j - 1), k, v)
            normed, state = head.finish(cache.attend(0, rows, q, seen + j, num_slots + j, scale), residual)
            token = head.to_target_ids(head.logits(normed).argmax(dim=-1))
            proposed.append(token)
        return (torch.stack(proposed, dim=1),)
