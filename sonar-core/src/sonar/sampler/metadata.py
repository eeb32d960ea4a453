"""Per-request sampling state and the per-step tensors the sampler reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar.sampler.dry import DryTensors, NgramTensors, build_dry, build_no_repeat_ngram
from sonar.sampler.mirostat import MirostatTensors
from sonar.sampler.penalties import PenaltyTensors, build_penalties
from sonar.sampler.rows import RowValues, build_row_values
from sonar.sampler.sampler_ids import SamplerID, resolve_order
from sonar.sampler.token_masks import AllowedTokens, build_allowed, build_banned, build_logit_bias
from sonar.sampler.xtc import XtcTensors
from sonar.sampling_params import SamplingParams
from sonar.tensors import to_device


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

    def __post_init__(self) -> None:
        self.reads_output_tokens = self.params.reads_output_tokens

    def prompt_ids_cpu(self) -> torch.Tensor:
        if self.prompt_ids_tensor is None:
            self.prompt_ids_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.int64)
        return self.prompt_ids_tensor

    def min_tokens_blocked_ids(self) -> list[int]:
        """Token ids that may not be sampled yet because min_tokens is not reached."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        blocked = list(self.params.stop_token_ids or [])
        if not self.params.ignore_eos:
            blocked += self.eos_token_ids
        return blocked

    def carry_over(self, previous: "RequestSamplingState") -> None:
        """Continue ``previous`` (the same request before a preemption): its generator and the
        samplers' running state."""
        self.generator = previous.generator
        self.mirostat_mu = previous.mirostat_mu


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling options as tensors; a field is None when no row needs that stage.

    Stages that shape the distribution (temperature onwards) cover random rows only; the
    penalty-like stages (bans, bias, allow-lists, penalties, DRY, no-repeat-ngram, logits
    processors) cover greedy rows too.
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
    # the ordered stages (SamplerID)
    penalties: PenaltyTensors | None
    processor_rows: dict[str, list[int]]  # processor name -> rows naming it
    dry: DryTensors | None
    no_repeat_ngram: NgramTensors | None
    temperature: RowValues | None  # (temperature,) for rows with a static T != 1
    dynatemp: RowValues | None  # (min, max, exponent)
    top_k: torch.Tensor | None  # [B] int64, V where off
    max_top_k: int  # largest top-k among rows using it
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    top_a: RowValues | None
    tfs: RowValues | None
    typical_p: RowValues | None
    eta_cutoff: RowValues | None
    epsilon_cutoff: RowValues | None
    top_nsigma: RowValues | None
    quadratic: RowValues | None  # (factor, curve)
    xtc: XtcTensors | None
    # after the ordered stages
    mirostat: MirostatTensors | None
    skew: RowValues | None
    order_groups: list[tuple[tuple[SamplerID, ...], list[int]]]  # (stage order, rows); one for most batches
    states: list[RequestSamplingState]

    @property
    def edits_logits(self) -> bool:
        """Whether any stage changes the logits (else greedy is a plain argmax)."""
        return any(
            value is not None
            for value in (
                self.banned, self.logit_bias, self.allowed, self.penalties, self.dry, self.no_repeat_ngram,
                self.temperature, self.dynatemp, self.top_k, self.top_p, self.min_p, self.top_a, self.tfs,
                self.typical_p, self.eta_cutoff, self.epsilon_cutoff, self.top_nsigma, self.quadratic,
                self.xtc, self.mirostat,
            )
        ) or bool(self.processor_rows)  # fmt: skip

    @classmethod
    def build(
        cls, states: list[RequestSamplingState], vocab_size: int, device: torch.device
    ) -> "SamplingMetadata":
        """Pack the options of ``states`` (one per logits row, in order) into tensors."""
        num_rows = len(states)
        params = [s.params for s in states]
        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def rows(pick) -> RowValues | None:
            return build_row_values(params, pick, device, skip=greedy)

        # top-k / top-p / min-p: full-batch tensors with neutral values
        top_k = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for g, p in zip(greedy, params)]
        top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        on_top_k = [k for k in top_k if k < vocab_size]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        processor_rows: dict[str, list[int]] = {}
        for row, p in enumerate(params):
            for name in p.logits_processors:
                processor_rows.setdefault(name, []).append(row)

        # stage order groups: rows sharing one order run together
        groups: dict[tuple[SamplerID, ...], list[int]] = {}
        for row, p in enumerate(params):
            groups.setdefault(resolve_order(p.sampler_priority, p.temperature_last), []).append(row)

        random_rows = [i for i, g in enumerate(greedy) if not g]
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
            penalties=build_penalties(states, vocab_size, device),
            processor_rows=processor_rows,
            dry=build_dry(states, [False] * num_rows, vocab_size, device),
            no_repeat_ngram=build_no_repeat_ngram(states, [False] * num_rows, vocab_size, device),
            temperature=rows(lambda p: None if p.temperature == 1.0 or p.uses_dynatemp else (p.temperature,)),
            dynatemp=rows(lambda p: (p.dynatemp_min, p.dynatemp_max, p.dynatemp_exponent) if p.uses_dynatemp else None),
            top_k=to_device(torch.tensor(top_k, dtype=torch.int64), device) if on_top_k else None,
            max_top_k=max(on_top_k, default=0),
            top_p=None if all(p >= 1.0 for p in top_p) else floats(top_p),
            min_p=None if all(p <= 0.0 for p in min_p) else floats(min_p),
            top_a=rows(lambda p: (p.top_a,) if p.top_a > 0.0 else None),
            tfs=rows(lambda p: (p.tfs,) if p.tfs < 1.0 else None),
            typical_p=rows(lambda p: (p.typical_p,) if p.typical_p < 1.0 else None),
            eta_cutoff=rows(lambda p: (p.eta_cutoff,) if p.eta_cutoff > 0.0 else None),
            epsilon_cutoff=rows(lambda p: (p.epsilon_cutoff,) if p.epsilon_cutoff > 0.0 else None),
            top_nsigma=rows(lambda p: (p.nsigma,) if p.nsigma > 0.0 else None),
            quadratic=rows(lambda p: (p.smoothing_factor, p.smoothing_curve) if p.smoothing_factor > 0.0 else None),
            xtc=_build_xtc(states, rows(lambda p: (p.xtc_threshold, p.xtc_probability) if p.xtc_probability > 0.0 else None)),
            mirostat=_build_mirostat(states, greedy, device),
            skew=rows(lambda p: (p.skew,) if p.skew != 0.0 else None),
            order_groups=list(groups.items()),
            states=states,
        )


def _build_xtc(states: list[RequestSamplingState], values: RowValues | None) -> XtcTensors | None:
    if values is None:
        return None
    return XtcTensors(values=values, generators=[states[row].generator for row in values.rows])


def _build_mirostat(states: list[RequestSamplingState], greedy: list[bool], device: torch.device) -> MirostatTensors | None:
    rows = [row for row, s in enumerate(states) if not greedy[row] and s.params.mirostat_mode != 0]
    if not rows:
        return None
    columns = []
    for row in rows:
        state, p = states[row], states[row].params
        mu = 2.0 * p.mirostat_tau if state.mirostat_mu is None else state.mirostat_mu
        columns.append((float(p.mirostat_mode), p.mirostat_tau, p.mirostat_eta, mu))
    values = to_device(torch.tensor(columns, dtype=torch.float32).T.contiguous(), device)  # [4, R]
    index = None if len(rows) == len(states) else to_device(torch.tensor(rows, dtype=torch.int64), device)
    return MirostatTensors(
        values=RowValues(rows=rows, index=index, values=tuple(values)), states=[states[row] for row in rows]
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
