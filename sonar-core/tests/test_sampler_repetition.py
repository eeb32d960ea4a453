"""Context-dependent samplers against plain per-request references: DRY, no-repeat-ngram,
repetition penalty range/slope, bad_words and allowed_token_ids."""

from __future__ import annotations

import random

import torch

from sonar.sampler import LogitsProcessor, RequestSamplingState, Sampler, SamplingMetadata
from sonar.sampling_params import SamplingParams

VOCAB = 40
CPU = torch.device("cpu")


def make_state(params: SamplingParams, prompt: list[int], output: list[int]) -> RequestSamplingState:
    return RequestSamplingState(params=params, prompt_token_ids=prompt, output_token_ids=output, generator=None, eos_token_ids=[0])


class Capture(LogitsProcessor):
    """Records the logits the processors see (after DRY, penalties and no-repeat-ngram)."""

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None

    def __call__(self, logits, rows, states):
        self.seen = logits.clone()
        return logits


def processed_logits(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """Logits after the penalty-like stages, as a logits processor registered last sees them."""
    capture = Capture()
    for state in states:
        state.params.logits_processors = ["capture"]
        state.params.sampler_priority = ["dry", "no_repeat_ngram", "penalties"]
    Sampler({"capture": capture})(logits, SamplingMetadata.build(states, logits.shape[1], CPU))
    assert capture.seen is not None
    return capture.seen


def repetitive_contexts(count: int, seed: int) -> list[list[int]]:
    """Token lists over a small alphabet with repeated phrases (so matches are long)."""
    rng = random.Random(seed)
    contexts = []
    for _ in range(count):
        phrase = [rng.randrange(1, 12) for _ in range(rng.randint(2, 6))]
        tokens: list[int] = []
        while len(tokens) < rng.randint(20, 60):
            tokens += phrase if rng.random() < 0.6 else [rng.randrange(1, 12)]
        contexts.append(tokens)
    return contexts


# --- references ------------------------------------------------------------------------------


def ref_dry(row: list[float], context: list[int], p: SamplingParams) -> list[float]:
    """p-e-w's DRY, as first written for text-generation-webui (one request, plain loops)."""
    if p.dry_range:
        context = context[-p.dry_range :]
    breakers = set(p.dry_sequence_breaker_ids or [])
    row = list(row)
    last = context[-1]
    if last in breakers:
        return row
    longest: dict[int, int] = {}
    for i in range(len(context) - 1):
        if context[i] != last:
            continue
        following = context[i + 1]
        if following in breakers:
            continue
        length = 1
        while True:
            j = i - length
            if j < 0 or context[j] in breakers or context[j] != context[-length - 1]:
                break
            length += 1
        longest[following] = max(length, longest.get(following, 0))
    for token, length in longest.items():
        if length >= max(p.dry_allowed_length, 1):
            row[token] -= p.dry_multiplier * p.dry_base ** (length - p.dry_allowed_length)
    return row


def ref_no_repeat_ngram(row: list[float], context: list[int], n: int) -> list[float]:
    """HF's rule: ban every token that would complete an n-gram already in the context."""
    row = list(row)
    if len(context) + 1 < n:
        return row
    prefix = tuple(context[len(context) - n + 1 :]) if n > 1 else ()
    for start in range(len(context) - n + 1):
        if tuple(context[start : start + n - 1]) == prefix:
            row[context[start + n - 1]] = float("-inf")
    return row


def ref_repetition(row: list[float], context: list[int], p: SamplingParams) -> list[float]:
    """KoboldCpp's rep_pen with rep_pen_range and rep_pen_slope."""
    window = context[-p.repetition_penalty_range :] if p.repetition_penalty_range else context
    half = len(window) // 2 if p.repetition_penalty_slope != 1.0 else 0
    far, near = set(window[:half]), set(window[half:])
    reduced = 1 + (p.repetition_penalty - 1) * p.repetition_penalty_slope if p.repetition_penalty > 1 else p.repetition_penalty
    row = list(row)
    for token in far | near:
        penalty = p.repetition_penalty if token in near else reduced
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    return row


# --- tests -----------------------------------------------------------------------------------


def test_dry_matches_reference() -> None:
    contexts = repetitive_contexts(12, seed=1)
    variants = [
        SamplingParams(dry_multiplier=0.8, temperature=0.0),
        SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=3),
        SamplingParams(dry_multiplier=0.5, dry_allowed_length=1, dry_sequence_breaker_ids=[3, 5]),
        SamplingParams(dry_multiplier=0.8, dry_range=15),
        SamplingParams(temperature=0.9),  # no DRY: untouched
        SamplingParams(dry_multiplier=0.8, dry_allowed_length=0),
    ]
    params = [variants[i % len(variants)].clone() for i in range(len(contexts))]
    logits = torch.randn(len(contexts), VOCAB, generator=torch.Generator().manual_seed(2))
    states = [make_state(p, c[:7], c[7:]) for p, c in zip(params, contexts)]
    seen = processed_logits(logits, states)
    penalised = 0
    for row, (p, context) in enumerate(zip(params, contexts)):
        expected = ref_dry(logits[row].tolist(), context, p) if p.dry_multiplier else logits[row].tolist()
        torch.testing.assert_close(seen[row].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=1e-5)
        penalised += int((seen[row] != logits[row]).any())
    assert penalised >= 6, "the contexts should trigger DRY on most rows"


def test_dry_sequence_breaker_as_last_token_turns_dry_off() -> None:
    p = SamplingParams(dry_multiplier=1.0, temperature=0.0, dry_sequence_breaker_ids=[9])
    logits = torch.zeros(2, VOCAB)
    context = [4, 5, 6, 9, 4, 5, 6, 9]  # "4 5 6 \n" twice; the last token is a breaker
    seen = processed_logits(logits, [make_state(p.clone(), context[:4], context[4:]), make_state(p.clone(), context[:4], context[4:-1])])
    assert torch.equal(seen[0], logits[0])
    assert seen[1][9] == 0.0, "a breaker is never penalised"


def test_no_repeat_ngram_matches_reference() -> None:
    contexts = repetitive_contexts(10, seed=3)
    sizes = [1, 2, 3, 4, 0, 2, 5, 3, 2, 1]
    params = [SamplingParams(no_repeat_ngram_size=n, temperature=0.0 if i % 3 else 1.0) for i, n in enumerate(sizes)]
    logits = torch.randn(len(contexts), VOCAB, generator=torch.Generator().manual_seed(4))
    states = [make_state(p, c[:5], c[5:]) for p, c in zip(params, contexts)]
    seen = processed_logits(logits, states)
    for row, (n, context) in enumerate(zip(sizes, contexts)):
        expected = ref_no_repeat_ngram(logits[row].tolist(), context, n) if n else logits[row].tolist()
        assert torch.equal(seen[row], torch.tensor(expected, dtype=torch.float32)), f"row {row} (n={n})"


def test_repetition_penalty_range_and_slope_match_koboldcpp() -> None:
    contexts = repetitive_contexts(8, seed=5)
    variants = [
        SamplingParams(repetition_penalty=1.3, repetition_penalty_range=10),
        SamplingParams(repetition_penalty=1.3, repetition_penalty_range=16, repetition_penalty_slope=0.3),
        SamplingParams(repetition_penalty=0.8, repetition_penalty_slope=0.5),
        SamplingParams(repetition_penalty=1.2),
    ]
    params = [variants[i % len(variants)].clone() for i in range(len(contexts))]
    logits = torch.randn(len(contexts), VOCAB, generator=torch.Generator().manual_seed(6)) * 2
    seen = processed_logits(logits, [make_state(p, c[:9], c[9:]) for p, c in zip(params, contexts)])
    for row, (p, context) in enumerate(zip(params, contexts)):
        expected = torch.tensor(ref_repetition(logits[row].tolist(), context, p))
        torch.testing.assert_close(seen[row], expected, atol=1e-5, rtol=1e-5)


def test_bad_words_ban_the_last_token_after_a_matching_prefix() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4, 7], [8]])
    states = [
        make_state(params, [1, 2], [3, 4]),  # prefix 3 4 matches: 7 banned, 8 always banned
        make_state(params, [1, 3], [4]),  # prefix across prompt and output
        make_state(params, [1, 2], [4, 3]),  # no match: 7 allowed
        make_state(SamplingParams(temperature=0.0), [1], [3, 4]),
    ]
    sampled = Sampler()(logits, SamplingMetadata.build(states, VOCAB, CPU)).sampled_token_ids.tolist()
    assert sampled[2] == 7 and sampled[3] == 7
    assert sampled[0] not in (7, 8) and sampled[1] not in (7, 8)


def test_allowed_token_ids_restrict_sampling() -> None:
    logits = torch.randn(200, VOCAB, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(allowed_token_ids=[3, 9, 21]) if i % 2 else SamplingParams(temperature=0.0) for i in range(200)]
    states = [make_state(p, [1], []) for p in params]
    sampled = Sampler()(logits, SamplingMetadata.build(states, VOCAB, CPU)).sampled_token_ids.tolist()
    assert {sampled[i] for i in range(1, 200, 2)} == {3, 9, 21}
    assert [sampled[i] for i in range(0, 200, 2)] == logits[::2].argmax(dim=-1).tolist()
