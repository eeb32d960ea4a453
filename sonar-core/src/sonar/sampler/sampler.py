"""The batched sampler: processed logits → next token ids (+ logprobs of the raw logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar import ops
from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import SamplingMetadata
from sonar.sampler.rows import row_exponentials
from sonar.sampler.shaping import apply_skew
from sonar.sampler.stage import SamplerStage, StageContext
from sonar.sampler.token_masks import apply_allowed, apply_banned, apply_logit_bias
from sonar.tensors import to_device

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_logprobs"]

@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # present when any request asked; k = max requested


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits batch, vectorized over the batch.

    Stages, each skipped when no row of the batch uses it and applied only to the rows that do:
    the fixed hard constraints first (bans from min_tokens and bad_words, logit_bias,
    allowed_token_ids); then the registered ``SamplerStage``\\ s in their order (Sonar's own:
    DRY → penalties and registered logits processors → no-repeat-ngram → temperature/dynatemp
    → top-nσ → top-k/top-p → top-a → min-p → TFS → eta → epsilon → typical-p → smoothing → XTC,
    with plugins' stages where they slot in; a request may reorder them with
    ``sampler_priority`` or ``temperature_last``); then the final stages (mirostat), softmax,
    skew, and the draw. Greedy rows take the argmax of the logits after the penalty-like stages.

    Random rows are sampled with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``:
    unseeded rows draw in one batched call, each seeded row from its own generator (as does
    XTC's coin), so a seeded request yields the same tokens alone or in any batch.

    The input logits are never modified; logprobs come from them (vLLM's "raw" logprobs).
    """

    def __init__(self, processors: dict[str, LogitsProcessor] | None = None) -> None:
        """:param processors: name → processor instances to use instead of looking names up
        in the plugin registry (names not given here are still looked up there)."""
        self._processors: dict[str, LogitsProcessor] = dict(processors or {})

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample ``[B]`` token ids from ``logits`` ``[B, V]`` (rows follow ``meta.states``)."""
        return self.sample(logits, meta)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """What calling the sampler does (a method of its own, so a benchmark can time it)."""
        raw_logits = logits
        logits = self.process(logits, meta)

        greedy_ids = None if meta.all_random else ops.argmax(logits)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            probs = self.final_probabilities(logits, meta)  # [B, V]
            q = row_exponentials(probs.shape, meta.generators, probs.device)
            random_ids = ops.argmax(probs / q)
            sampled = random_ids if greedy_ids is None else torch.where(meta.greedy_mask, greedy_ids, random_ids)
            for name, tensors in (meta.stage_tensors or {}).items():
                self._stage(name).on_sampled(tensors, probs, sampled)

        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def probabilities(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """``[B, V]`` the distribution each random row samples from, after every stage
        (renormalised). ``logits`` is not modified; XTC's coin is drawn as in a real step."""
        return self.final_probabilities(self.process(logits, meta), meta)

    # -- stages ------------------------------------------------------------------------------

    def process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """``[B, V]`` float32 logits after every stage up to mirostat (a new tensor when any
        stage runs; the input is never modified)."""
        processed = logits.float()
        if not meta.edits_logits:
            return processed
        if processed is logits:
            processed = processed.clone()  # every stage below may work in place

        self._apply_hard_constraints(processed, meta)

        # the ordered stages, per group of rows sharing one order
        if len(meta.order_groups) == 1:
            order, _ = meta.order_groups[0]
            processed = self._run_ordered(processed, meta, order, list(range(meta.num_rows)))
        else:
            for order, rows in meta.order_groups:
                sub_meta = SamplingMetadata.build([meta.states[r] for r in rows], processed.shape[1], processed.device)
                index = to_device(torch.tensor(rows, dtype=torch.int64), processed.device)
                processed[index] = self._run_ordered(processed[index], sub_meta, order, rows)
        return self._revive_dead_rows(processed, logits, meta)

    @staticmethod
    def _apply_hard_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Bans, logit bias and allowed tokens, on every row, in place; returns ``logits``."""
        if meta.banned is not None:
            apply_banned(logits, meta.banned)
        if meta.logit_bias is not None:
            apply_logit_bias(logits, meta.logit_bias)
        if meta.allowed is not None:
            apply_allowed(logits, meta.allowed)
        return logits

    @staticmethod
    def _revive_dead_rows(processed: torch.Tensor, raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A row whose every token was removed (say allowed_token_ids=[5] with a ban on 5)
        falls back to its hard constraints alone, and failing that to the raw logits: it
        never samples from an empty distribution. (On an accelerator the fallback is computed
        whether or not a row died: asking would make the host wait for the device.)"""
        dead = processed.amax(dim=-1) == float("-inf")
        if processed.device.type == "cpu" and not bool(dead.any()):
            return processed
        raw = raw.float()
        fallback = Sampler._apply_hard_constraints(raw.clone(), meta)
        still_dead = fallback.amax(dim=-1) == float("-inf")
        fallback = torch.where(still_dead[:, None], raw, fallback)
        return torch.where(dead[:, None], fallback, processed)

    def final_probabilities(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The final stages (mirostat), softmax and skew on processed logits (modified in place)."""
        if meta.final_stages is not None and meta.stage_tensors is not None:
            context = StageContext(meta.states, list(range(meta.num_rows)), self._processor)
            for stage in meta.final_stages:
                logits = stage.apply(logits, meta.stage_tensors[stage.name], context)
        probs = logits.softmax(dim=-1)
        if meta.skew is not None:
            probs = meta.skew.apply(probs, apply_skew)
        return probs

    def _run_ordered(
        self, logits: torch.Tensor, meta: SamplingMetadata, order: tuple[SamplerStage, ...], batch_rows: list[int]
    ) -> torch.Tensor:
        tensors = meta.stage_tensors
        if not tensors:
            return logits
        context = StageContext(meta.states, batch_rows, self._processor)
        for stage in order:
            built = tensors.get(stage.name)
            if built is not None:
                logits = stage.apply(logits, built, context)
        return logits

    @staticmethod
    def _stage(name: str) -> SamplerStage:
        from sonar import registry

        return registry.sampler_stages().by_name[name]

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

