"""Per-request sampling state and the per-step tensors the sampler reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestSamplingState:
    """What the sampler needs to know about one running request (kept by the model runner)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # grows by one each decode step (the runner appends)
    generator: torch.Generator | None  # seeded per request when params.seed is not None
    eos_token_ids: list[int]  # model eos; masked while len(output) < min_tokens unless ignore_eos
    prompt_ids_tensor: torch.Tensor | None = field(default=None, repr=False)  # cached, CPU int64

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


@dataclass(slots=True)
class PenaltyTensors:
    repetition: torch.Tensor | None  # [B] float32; None: no row uses repetition_penalty
    seen_mask: torch.Tensor | None  # [B, V] bool: token occurs in prompt or output
    presence: torch.Tensor | None  # [B] float32; None: no row uses presence/frequency
    frequency: torch.Tensor | None  # [B] float32
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling options as tensors; a field is None when no row needs that stage."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only for mixed batches
    temperature: torch.Tensor | None  # [B] float32 (1.0 on greedy rows); None: all 1.0
    top_k: torch.Tensor | None  # [B] int64, V where off
    max_top_k: int  # largest top-k among rows using it
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    generators: dict[int, torch.Generator]  # row -> seeded generator (random rows only)
    max_num_logprobs: int | None  # largest `logprobs` asked for; None: nobody asked
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to set -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, bias)
    penalties: PenaltyTensors | None
    processor_rows: dict[str, list[int]]  # processor name -> rows naming it
    states: list[RequestSamplingState]

    @property
    def edits_logits(self) -> bool:
        """Whether any stage before greedy/sampling changes the logits."""
        return (
            self.min_tokens_mask is not None
            or self.logit_bias is not None
            or self.penalties is not None
            or bool(self.processor_rows)
        )

    @property
    def truncates(self) -> bool:
        """Whether random rows need temperature, top-k, top-p or min-p (in place on logits)."""
        return not self.all_greedy and not (
            self.temperature is None and self.top_k is None and self.top_p is None and self.min_p is None
        )

    @classmethod
    def build(
        cls, states: list[RequestSamplingState], vocab_size: int, device: torch.device
    ) -> "SamplingMetadata":
        """Pack the options of ``states`` (one per logits row, in order) into tensors."""
        num_rows = len(states)
        greedy = [s.params.greedy for s in states]
        all_greedy, all_random = all(greedy), not any(greedy)

        # per-row scalars (greedy rows carry neutral values)
        temperature = [1.0 if g else s.params.temperature for g, s in zip(greedy, states)]
        top_k = [
            vocab_size if g or s.params.top_k <= 0 else min(s.params.top_k, vocab_size)
            for g, s in zip(greedy, states)
        ]
        top_p = [1.0 if g else s.params.top_p for g, s in zip(greedy, states)]
        min_p = [0.0 if g else s.params.min_p for g, s in zip(greedy, states)]
        on_top_k = [k for k in top_k if k < vocab_size]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        requested = [s.params.logprobs for s in states if s.params.logprobs is not None]
        processor_rows: dict[str, list[int]] = {}
        for row, state in enumerate(states):
            for name in state.params.logits_processors:
                processor_rows.setdefault(name, []).append(row)

        return cls(
            num_rows=num_rows,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else torch.tensor(greedy).to(device),
            temperature=None if all(t == 1.0 for t in temperature) else floats(temperature),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(device) if on_top_k else None,
            max_top_k=max(on_top_k, default=0),
            top_p=None if all(p >= 1.0 for p in top_p) else floats(top_p),
            min_p=None if all(p <= 0.0 for p in min_p) else floats(min_p),
            generators={
                row: s.generator
                for row, (g, s) in enumerate(zip(greedy, states))
                if not g and s.generator is not None
            },
            max_num_logprobs=max(requested) if requested else None,
            min_tokens_mask=_build_min_tokens_mask(states, vocab_size, device),
            logit_bias=_build_logit_bias(states, vocab_size, device),
            penalties=_build_penalties(states, vocab_size, device),
            processor_rows=processor_rows,
            states=states,
        )


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError when ``params`` names a token id outside the vocabulary.

    Call it when a request is admitted; the sampler itself silently ignores such ids.
    """
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary of {vocab_size} tokens")


def _build_min_tokens_mask(
    states: list[RequestSamplingState], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        for token_id in state.min_tokens_blocked_ids():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(ids, dtype=torch.int64).to(device)


def _build_logit_bias(
    states: list[RequestSamplingState], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, state in enumerate(states):
        for token_id, bias in (state.params.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
                biases.append(bias)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64).to(device),
        torch.tensor(ids, dtype=torch.int64).to(device),
        torch.tensor(biases, dtype=torch.float32).to(device),
    )


def _occurrence_counts(
    token_lists: list[torch.Tensor], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[B, V]`` float32 counts of each token id per row (ids outside the vocab dropped)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    ids = torch.cat(token_lists).to(device) if token_lists else torch.empty(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths).to(device)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # overflow column
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts[:, :vocab_size]


def _build_penalties(
    states: list[RequestSamplingState], vocab_size: int, device: torch.device
) -> PenaltyTensors | None:
    repetition = [s.params.repetition_penalty for s in states]
    presence = [s.params.presence_penalty for s in states]
    frequency = [s.params.frequency_penalty for s in states]
    use_repetition = any(p != 1.0 for p in repetition)
    use_additive = any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency)
    if not (use_repetition or use_additive):
        return None

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device)

    # [B, V] output counts: needed by both kinds
    num_rows = len(states)
    outputs = [torch.tensor(s.output_token_ids, dtype=torch.int64) for s in states]
    output_counts = _occurrence_counts(outputs, num_rows, vocab_size, device)
    seen_mask = None
    if use_repetition:
        prompts = [s.prompt_ids_cpu() for s in states]
        seen_mask = (_occurrence_counts(prompts, num_rows, vocab_size, device) > 0) | (output_counts > 0)
    return PenaltyTensors(
        repetition=floats(repetition) if use_repetition else None,
        seen_mask=seen_mask,
        presence=floats(presence) if use_additive else None,
        frequency=floats(frequency) if use_additive else None,
        output_counts=output_counts if use_additive else None,
    )
