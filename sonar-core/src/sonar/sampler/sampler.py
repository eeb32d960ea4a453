"""The batched sampler: processed logits → next token ids (+ logprobs of the raw logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import SamplingMetadata
from sonar.sampler.penalties import apply_logit_bias, apply_min_tokens_mask, apply_penalties
from sonar.sampler.topk_topp import apply_min_p, apply_top_k_top_p

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_logprobs"]


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # present when any request asked; k = max requested


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits batch, vectorized over the batch.

    Stages (each skipped when no row needs it): min_tokens masking → logit_bias → penalties →
    registered logits processors → greedy argmax, or temperature → top-k → top-p → min-p →
    sampling. Random rows are sampled with the exponential race ``argmax(probs / q)``,
    ``q ~ Exp(1)``: unseeded rows draw ``q`` in one batched call, each seeded row from its own
    generator, so a seeded request yields the same tokens alone or in any batch.

    The input logits are never modified; logprobs come from them (vLLM's "raw" logprobs).
    """

    def __init__(self, processors: dict[str, LogitsProcessor] | None = None) -> None:
        """:param processors: name → processor instances to use instead of looking names up
        in the plugin registry (names not given here are still looked up there)."""
        self._processors: dict[str, LogitsProcessor] = dict(processors or {})

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample ``[B]`` token ids from ``logits`` ``[B, V]`` float32 (rows follow ``meta.states``)."""
        raw_logits = logits
        logits = logits.float()
        if logits is raw_logits and (meta.edits_logits or meta.truncates):
            logits = logits.clone()  # every stage below works in place

        # logit edits
        if meta.min_tokens_mask is not None:
            apply_min_tokens_mask(logits, meta.min_tokens_mask)
        if meta.logit_bias is not None:
            apply_logit_bias(logits, meta.logit_bias)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        if meta.processor_rows:
            self._apply_processors(logits, meta)

        # greedy
        greedy_ids = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = self._sample(logits, meta)
            sampled = random_ids if greedy_ids is None else torch.where(meta.greedy_mask, greedy_ids, random_ids)

        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def probabilities(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """``[B, V]`` the distribution each random row samples from, after truncation (renormalised).

        ``logits`` must already carry the logit edits; it is modified in place.
        """
        if meta.temperature is not None:
            logits.div_(meta.temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        return logits.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        probs = self.probabilities(logits, meta)  # [B, V]
        # exponential race: argmax(p / q), q ~ Exp(1), is a draw from p
        q = torch.empty_like(probs).exponential_()
        for row, generator in meta.generators.items():
            q[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)

    def _apply_processors(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        for name, rows in meta.processor_rows.items():
            processor = self._processor(name)
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            states = [meta.states[row] for row in rows]
            logits[index] = processor(logits[index], rows, states).to(logits.dtype)

    def _processor(self, name: str) -> LogitsProcessor:
        if name not in self._processors:
            from sonar import registry

            factories = registry.logits_processors()
            if name not in factories:
                raise ValueError(
                    f"logits processor {name!r} is not registered; registered: {sorted(factories)} "
                    "(install the plugin that provides it)"
                )
            self._processors[name] = factories[name]()
        return self._processors[name]
