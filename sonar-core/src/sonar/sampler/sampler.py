"""The batched sampler: processed logits → next token ids (+ logprobs of the raw logits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sonar import ops
from sonar.sampler.dry import apply_dry, apply_no_repeat_ngram
from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import SamplingMetadata
from sonar.sampler.mirostat import apply_mirostat, update_mirostat
from sonar.sampler.penalties import apply_penalties
from sonar.sampler.rows import row_exponentials
from sonar.sampler.sampler_ids import SamplerID
from sonar.sampler.shaping import apply_quadratic, apply_skew
from sonar.sampler.temperature import apply_dynatemp, apply_temperature
from sonar.sampler.token_masks import apply_allowed, apply_banned, apply_logit_bias
from sonar.sampler.topk_topp import apply_min_p, apply_top_k_top_p
from sonar.sampler.truncation import (
    apply_epsilon_cutoff,
    apply_eta_cutoff,
    apply_tfs,
    apply_top_a,
    apply_top_nsigma,
    apply_typical_p,
)
from sonar.sampler.xtc import run_xtc
from sonar.tensors import to_device

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_logprobs"]

Stage = Callable[["Sampler", torch.Tensor, SamplingMetadata, list[int]], torch.Tensor]


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # present when any request asked; k = max requested


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits batch, vectorized over the batch.

    Stages, each skipped when no row of the batch uses it and applied only to the rows that do:
    bans (min_tokens, bad_words), logit_bias, allowed_token_ids; then the ordered stages
    (``SamplerID``; default order DRY → penalties and registered logits processors →
    no-repeat-ngram → temperature/dynatemp → top-nσ → top-k/top-p → top-a → min-p → TFS → eta
    → epsilon → typical-p → smoothing → XTC; a request may reorder them with
    ``sampler_priority`` or ``temperature_last``); then mirostat, softmax, skew, and the draw.
    Greedy rows take the argmax of the logits after the penalty-like stages.

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
            if meta.mirostat is not None:
                rows = meta.mirostat.values.index
                chosen = probs.gather(1, sampled.unsqueeze(1)).squeeze(1)
                update_mirostat(meta.mirostat, chosen if rows is None else chosen[rows])

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
        """Mirostat truncation, softmax and skew on processed logits (modified in place)."""
        if meta.mirostat is not None:
            mode, _, _, mu = meta.mirostat.values.values
            logits = meta.mirostat.values.apply(logits, lambda sub, *_: apply_mirostat(sub, mode, mu))
        probs = logits.softmax(dim=-1)
        if meta.skew is not None:
            probs = meta.skew.apply(probs, apply_skew)
        return probs

    def _run_ordered(
        self, logits: torch.Tensor, meta: SamplingMetadata, order: tuple[SamplerID, ...], batch_rows: list[int]
    ) -> torch.Tensor:
        for stage in order:
            logits = _STAGES[stage](self, logits, meta, batch_rows)
        return logits

    def _penalties(self, logits: torch.Tensor, meta: SamplingMetadata, batch_rows: list[int]) -> torch.Tensor:
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        for name, rows in meta.processor_rows.items():
            processor = self._processor(name)
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            states = [meta.states[row] for row in rows]
            logits[index] = processor(logits[index], [batch_rows[row] for row in rows], states).to(logits.dtype)
        return logits

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


def _temperature(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    if meta.temperature is not None:
        logits = meta.temperature.apply(logits, apply_temperature)
    if meta.dynatemp is not None:
        logits = meta.dynatemp.apply(logits, apply_dynatemp)
    return logits


def _row_stage(field: str, fn: Callable[..., torch.Tensor]) -> Stage:
    def stage(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        values = getattr(meta, field)
        return logits if values is None else values.apply(logits, fn)

    return stage


def _top_k_top_p(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    return apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)


def _min_p(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    return logits if meta.min_p is None else apply_min_p(logits, meta.min_p)


def _dry(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    return logits if meta.dry is None else apply_dry(logits, meta.dry)


def _no_repeat_ngram(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    return logits if meta.no_repeat_ngram is None else apply_no_repeat_ngram(logits, meta.no_repeat_ngram)


def _xtc(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    return logits if meta.xtc is None else run_xtc(logits, meta.xtc)


_STAGES: dict[SamplerID, Stage] = {
    SamplerID.DRY: _dry,
    SamplerID.PENALTIES: Sampler._penalties,
    SamplerID.NO_REPEAT_NGRAM: _no_repeat_ngram,
    SamplerID.TEMPERATURE: _temperature,
    SamplerID.TOP_NSIGMA: _row_stage("top_nsigma", apply_top_nsigma),
    SamplerID.TOP_P_TOP_K: _top_k_top_p,
    SamplerID.TOP_A: _row_stage("top_a", apply_top_a),
    SamplerID.MIN_P: _min_p,
    SamplerID.TFS: _row_stage("tfs", apply_tfs),
    SamplerID.ETA_CUTOFF: _row_stage("eta_cutoff", apply_eta_cutoff),
    SamplerID.EPSILON_CUTOFF: _row_stage("epsilon_cutoff", apply_epsilon_cutoff),
    SamplerID.TYPICAL_P: _row_stage("typical_p", apply_typical_p),
    SamplerID.QUADRATIC: _row_stage("quadratic", apply_quadratic),
    SamplerID.XTC: _xtc,
}
