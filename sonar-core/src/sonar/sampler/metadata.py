"""Per-request sampling state and the per-step tensors the sampler reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sonar.sampler.rows import RowValues, build_row_values
from sonar.sampler.stage import SamplerStage
from sonar.sampler.token_masks import AllowedTokens, build_allowed, build_banned, build_logit_bias
from sonar.sampling_params import SamplingParams
from sonar.tensors import to_device

LOGIT_BIAS_LIMIT = 100.0  # |logit_bias| applied at most (OpenAI's range for the field)


@dataclass(slots=True)
class RequestSamplingState:
    """What the sampler needs to know about one running request (kept by the model runner).

    Sampler state that must survive between steps lives here too (``mirostat_mu``). When a
    request is preempted and its state rebuilt, ``carry_over(previous)`` keeps it.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # grows by one each decode step (the runner appends)
    generator: torch.Generator | None  # seeded per request when params.seed is not None
    eos_token_ids: list[int]  # model eos; masked while len(output) < min_tokens unless ignore_eos
    prompt_ids_tensor: torch.Tensor | None = field(default=None, repr=False)  # cached, CPU int64
    mirostat_mu: float | None = None  # None: not started (2 * tau)
    reads_output_tokens: bool = field(init=False)  # sampling needs the earlier tokens' values
    # the request's fixed constraints in the form each step reads, built once (a request may
    # carry a whole vocabulary of them: per step they are then copies, not Python loops)
    _constraints: dict[str, Any] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.reads_output_tokens = self.params.reads_output_tokens

    def prompt_ids_cpu(self) -> torch.Tensor:
        if self.prompt_ids_tensor is None:
            self.prompt_ids_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.int64)
        return self.prompt_ids_tensor

    def logit_bias_tensors(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, biases)`` of ``logit_bias`` inside the vocabulary, CPU int64 / float32, each
        bias clamped to +-100 as OpenAI's API defines the field (a bias that large already
        decides the token; a larger one would overflow float32 logits once divided by a low
        temperature)."""
        key = ("logit_bias", vocab_size)
        if key not in self._constraints:
            bias = self.params.logit_bias or {}
            ids = torch.tensor(list(bias), dtype=torch.int64)
            biases = torch.tensor(list(bias.values()), dtype=torch.float32).clamp_(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
            inside = (ids >= 0) & (ids < vocab_size)
            self._constraints[key] = (ids[inside], biases[inside])
        return self._constraints[key]

    def dry_breaker_mask(self, vocab_size: int) -> torch.Tensor:
        """``[V + 1]`` bool: True for DRY's sequence breakers inside the vocabulary; the extra
        last column (padding and ids outside the vocabulary) is False."""
        key = ("dry_breakers", vocab_size)
        if key not in self._constraints:
            ids = torch.tensor(self.params.dry_sequence_breaker_ids or [], dtype=torch.int64)
            mask = torch.zeros(vocab_size + 1, dtype=torch.bool)
            mask[ids[(ids >= 0) & (ids < vocab_size)]] = True
            self._constraints[key] = mask
        return self._constraints[key]

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """``[V]`` bool: True for ``allowed_token_ids`` inside the vocabulary."""
        key = ("allowed", vocab_size)
        if key not in self._constraints:
            keep = torch.zeros(vocab_size, dtype=torch.bool)
            keep[[t for t in self.params.allowed_token_ids or () if 0 <= t < vocab_size]] = True
            self._constraints[key] = keep
        return self._constraints[key]

    def banned_ids(self) -> list[int]:
        """Token ids this step may not sample: eos/stop ids before ``min_tokens``, and the last
        token of each bad word whose earlier tokens end the context (a one-token bad word always).
        Only the words whose prefix ends in the context's last token are compared."""
        banned = self.min_tokens_blocked_ids()
        words = self.params.bad_words_token_ids
        if not words:
            return banned
        index = self._constraints.get("bad_words")
        if index is None:
            distinct = [list(word) for word in dict.fromkeys(tuple(word) for word in words)]
            always = [word[-1] for word in distinct if len(word) == 1]
            by_last: dict[int, list[list[int]]] = {}
            for word in distinct:
                if len(word) > 1:
                    by_last.setdefault(word[-2], []).append(word)
            index = self._constraints["bad_words"] = (always, by_last)
        always, by_last = index
        banned = banned + always
        context_end = self.output_token_ids[-1] if self.output_token_ids else (self.prompt_token_ids[-1] if self.prompt_token_ids else None)
        for word in by_last.get(context_end, ()):  # type: ignore[arg-type]
            if self._context_ends_with(word[:-1]):
                banned.append(word[-1])
        return banned

    def _context_ends_with(self, prefix: list[int]) -> bool:
        output, n = self.output_token_ids, len(prefix)
        if len(output) >= n:
            return output[-n:] == prefix
        head = n - len(output)
        return len(self.prompt_token_ids) >= head and self.prompt_token_ids[-head:] + output == prefix

    def min_tokens_blocked_ids(self) -> list[int]:
        """Token ids that may not be sampled yet because min_tokens is not reached."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        blocked = list(self.params.stop_token_ids or [])
        if not self.params.ignore_eos:
            blocked += self.eos_token_ids
        return blocked

    def carry_over(self, previous: RequestSamplingState) -> None:
        """Continue ``previous`` (the same request before a preemption): its generator and the
        samplers' running state."""
        self.generator = previous.generator
        self.mirostat_mu = previous.mirostat_mu


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling options as tensors; a stage is absent when no row needs it.

    Stages that shape the distribution (temperature onwards) cover random rows only; the
    penalty-like stages (bans, bias, allow-lists, penalties, DRY, no-repeat-ngram, logits
    processors, and any registered stage with ``covers_greedy``) cover greedy rows too.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only for mixed batches
    generators: dict[int, torch.Generator]  # row -> seeded generator (random rows only)
    max_num_logprobs: int | None  # largest `logprobs` asked for; None: nobody asked
    # every row, before the ordered stages
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, bias)
    allowed: AllowedTokens | None
    # the registered stages some row uses: name -> what its build returned; None: none is used
    stage_tensors: dict[str, Any] | None
    final_stages: tuple[SamplerStage, ...] | None  # those of them after the ordered stages, in order
    # after the stages, on probabilities
    skew: RowValues | None
    order_groups: list[tuple[tuple[SamplerStage, ...], list[int]]]  # (stage order, rows); one for most batches
    states: list[RequestSamplingState]

    @property
    def edits_logits(self) -> bool:
        """Whether any stage changes the logits (else greedy is a plain argmax)."""
        return bool(self.stage_tensors) or any(value is not None for value in (self.banned, self.logit_bias, self.allowed))

    @classmethod
    def build(
        cls, states: list[RequestSamplingState], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """Pack the options of ``states`` (one per logits row, in order) into tensors."""
        from sonar.registry import sampler_stages

        table = sampler_stages()
        num_rows = len(states)
        params = [s.params for s in states]
        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        stage_tensors: dict[str, Any] = {}
        for stage in table.stages:
            candidates = range(num_rows) if stage.covers_greedy else random_rows
            uses = stage.uses
            rows = [row for row in candidates if uses(params[row])]
            if rows:
                tensors = stage.build(states, rows, vocab_size, device)
                if tensors is not None:
                    stage_tensors[stage.name] = tensors

        # stage order groups: rows sharing one order run together
        if all(p.sampler_priority is None and not p.temperature_last for p in params):
            order_groups = [(table.ordered, list(range(num_rows)))]
        else:
            groups: dict[tuple[SamplerStage, ...], list[int]] = {}
            for row, p in enumerate(params):
                groups.setdefault(table.order(p.sampler_priority, p.temperature_last), []).append(row)
            order_groups = list(groups.items())

        return cls(
            num_rows=num_rows,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else to_device(torch.tensor(greedy), device),
            generators={row: states[row].generator for row in random_rows if states[row].generator is not None},
            max_num_logprobs=max(requested) if requested else None,
            banned=build_banned(states, vocab_size, device),
            logit_bias=build_logit_bias(states, vocab_size, device),
            allowed=build_allowed(states, vocab_size, device),
            stage_tensors=stage_tensors or None,
            final_stages=tuple(stage for stage in table.final if stage.name in stage_tensors) or None,
            skew=build_row_values(params, lambda p: (p.skew,) if p.skew != 0.0 else None, device, skip=greedy),
            order_groups=order_groups,
            states=states,
        )


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when ``params`` names a token id outside the vocabulary.

    Call it when a request is admitted; the sampler itself silently ignores such ids.
    """
    fields = (
        ("logit_bias", list(params.logit_bias or {})),
        ("stop_token_ids", params.stop_token_ids or []),
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("bad_words_token_ids", [t for word in params.bad_words_token_ids or [] for t in word]),
        ("dry_sequence_breaker_ids", params.dry_sequence_breaker_ids or []),
    )
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary of {vocab_size} tokens")
