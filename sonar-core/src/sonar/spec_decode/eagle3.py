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
"""

from __future__ import annotations

import torch

from sonar.spec_decode.eagle3_cache import DraftKVCache
from sonar.spec_decode.eagle3_checkpoint import load_eagle3, read_eagle3_config
from sonar.spec_decode.eagle3_head import Eagle3Head
from sonar.spec_decode.interface import DraftTokens, Proposer, ProposerInputs, SpeculativeConfig


def target_embedding(target_model: torch.nn.Module) -> torch.nn.Module:
    """The target's token embedding (the module named ``embed_tokens``)."""
    for name, module in target_model.named_modules():
        if name.split(".")[-1] == "embed_tokens":
            return module
    raise ValueError(f"{type(target_model).__name__} has no embed_tokens module to lend an EAGLE-3 head")


class Eagle3Proposer(Proposer):
    """Drafts with an EAGLE-3 head over the target's auxiliary hidden states."""

    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.check_config(config)
        self.head: Eagle3Head | None = None
        self.embed: torch.nn.Module | None = None
        self.cache: DraftKVCache | None = None

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
        self.cache = DraftKVCache(config.num_key_value_heads, config.head_dim, dtype, self.device)

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
        head, cache = self.head, self.cache
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
        if not drafting:
            return DraftTokens(list(inputs.req_ids), drafts)
        device = inputs.hidden_states.device
        scale = head.config.head_dim**-0.5
        # 1. the target's states: every slot's keys and values kept, the last slot attended
        hidden = head.combine(inputs.hidden_states)
        embeds = self.embed(torch.tensor(next_ids, dtype=torch.int64, device=device))
        q, k, v, residual = head.project(hidden, embeds, inputs.positions)
        last_rows = []
        for i, (first, count, _) in enumerate(spans):
            if count:
                cache.append(inputs.req_ids[i], k[first : first + count], v[first : first + count], commit=True)
            if i in drafting:
                last_rows.append(first + count - 1)
        last = torch.tensor(last_rows, dtype=torch.int64, device=device)
        req_ids = [inputs.req_ids[i] for i in drafting]
        attn = torch.cat([cache.attend(r, q[row : row + 1], scale) for r, row in zip(req_ids, last_rows)])
        normed, state = head.finish(attn, residual[last])
        token = head.to_target_ids(head.logits(normed).argmax(dim=-1))
        proposed = [token]
        # 2. the head's own states, one slot per request and draft
        slot_positions = inputs.positions[last]
        for _ in range(self.config.num_speculative_tokens - 1):
            slot_positions = slot_positions + 1
            q, k, v, residual = head.project(state, self.embed(token), slot_positions)
            outputs = []
            for j, req_id in enumerate(req_ids):
                cache.append(req_id, k[j : j + 1], v[j : j + 1], commit=False)
                outputs.append(cache.attend(req_id, q[j : j + 1], scale))
            normed, state = head.finish(torch.cat(outputs), residual)
            token = head.to_target_ids(head.logits(normed).argmax(dim=-1))
            proposed.append(token)
        # 3. the guessed slots leave the head's cache
        for req_id in req_ids:
            cache.rollback(req_id)
        for i, tokens in zip(drafting, torch.stack(proposed, dim=1).tolist()):
            drafts[i] = tokens
        return DraftTokens(list(inputs.req_ids), drafts)
