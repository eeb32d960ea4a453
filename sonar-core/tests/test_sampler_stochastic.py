"""Stochastic samplers: XTC's removal rate, mirostat's surprise tracking, seeded requests in a
mixed batch of 64, and mirostat state across a preemption."""

from __future__ import annotations

import math

import pytest
import torch

from sonar.sampler import RequestSamplingState, Sampler, SamplingMetadata
from sonar.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_state(params: SamplingParams, prompt: list[int] | None = None) -> RequestSamplingState:
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return RequestSamplingState(
        params=params, prompt_token_ids=list(prompt or [1, 2, 3]), output_token_ids=[], generator=generator, eos_token_ids=[0]
    )


def zipf_logits(steps: int, vocab: int, seed: int) -> torch.Tensor:
    """``[steps, V]`` logits of Zipf-like distributions (exponent ~1.1) in shuffled token order."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * torch.log(ranks)
    rows = [base[torch.randperm(vocab, generator=gen)] + 0.3 * torch.randn(vocab, generator=gen) for _ in range(steps)]
    return torch.stack(rows)


def test_xtc_removes_top_choices_at_its_probability() -> None:
    draws, probability = 4000, 0.3
    row = torch.tensor([3.0, 2.8, 2.5, 0.0, -1.0] + [-3.0] * 45)  # three tokens above 10%
    logits = row.expand(draws, -1).contiguous()
    params = SamplingParams(xtc_probability=probability, xtc_threshold=0.1)
    probs = Sampler().probabilities(logits, SamplingMetadata.build([make_state(params)] * draws, 50, CPU))
    removed = probs[:, 0] == 0
    assert torch.equal(removed, probs[:, 1] == 0), "the top two go together"
    assert (probs[:, 2] > 0).all(), "the least likely token above the threshold stays"
    rate = removed.double().mean().item()
    sigma = math.sqrt(probability * (1 - probability) / draws)
    assert abs(rate - probability) < 4 * sigma, f"removal rate {rate:.3f}, expected {probability}"


def test_xtc_coin_of_a_seeded_request_comes_from_its_generator() -> None:
    params = SamplingParams(xtc_probability=0.5, xtc_threshold=0.1, seed=11)
    row = torch.tensor([[3.0, 2.8, 2.5] + [-3.0] * 47])

    def removals(state: RequestSamplingState, batch_noise: int) -> list[bool]:
        out = []
        for _ in range(40):
            torch.rand(batch_noise)  # unrelated draws from the global generator
            meta = SamplingMetadata.build([state], 50, CPU)
            out.append(bool(Sampler().probabilities(row.clone(), meta)[0, 0] == 0))
        return out

    first = removals(make_state(params), 1)
    assert first == removals(make_state(params), 17)
    assert 5 < sum(first) < 35


@pytest.mark.parametrize("mode,tau,tolerance", [(2, 3.0, 0.25), (2, 5.0, 0.3), (1, 4.0, 0.5)])
def test_mirostat_surprise_tracks_tau(mode: int, tau: float, tolerance: float) -> None:
    steps, vocab = 600, 2000
    logits = zipf_logits(steps, vocab, seed=mode * 10 + int(tau))
    state = make_state(SamplingParams(mirostat_mode=mode, mirostat_tau=tau, mirostat_eta=0.1, seed=5))
    sampler = Sampler()
    surprises = []
    for step in range(steps):
        meta = SamplingMetadata.build([state], vocab, CPU)
        mu_before = state.mirostat_mu
        probs = sampler.probabilities(logits[step : step + 1].clone(), meta)[0]
        state.mirostat_mu = mu_before  # probabilities() does not move mu; sample from the same state
        token = sampler(logits[step : step + 1], meta).sampled_token_ids.item()
        state.output_token_ids.append(token)
        surprises.append(-math.log2(probs[token].item()))
    late = surprises[100:]
    mean = sum(late) / len(late)
    assert abs(mean - tau) < tolerance, f"mean surprise {mean:.2f} vs tau {tau}"
    assert state.mirostat_mu is not None and state.mirostat_mu != 2 * tau


def test_mirostat_state_survives_a_preemption() -> None:
    logits = zipf_logits(30, 500, seed=3)
    params = SamplingParams(mirostat_mode=2, mirostat_tau=3.0, seed=9)

    def run(preempt_at: int | None) -> list[int]:
        state = make_state(params)
        tokens = []
        for step in range(30):
            if step == preempt_at:  # the runner rebuilds the state on resume
                resumed = RequestSamplingState(params, state.prompt_token_ids, list(state.output_token_ids), None, [0])
                resumed.carry_over(state)
                state = resumed
            meta = SamplingMetadata.build([state], 500, CPU)
            token = Sampler()(logits[step : step + 1], meta).sampled_token_ids.item()
            state.output_token_ids.append(token)
            tokens.append(token)
        return tokens

    assert run(None) == run(12)


MIXED = [
    dict(temperature=0.0, dry_multiplier=0.8),
    dict(temperature=0.9, top_k=40, top_p=0.9),
    dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05),
    dict(temperature=1.0, mirostat_mode=2, mirostat_tau=4.0),
    dict(temperature=1.0, mirostat_mode=1, mirostat_tau=5.0),
    dict(temperature=0.8, typical_p=0.8, tfs=0.9),
    dict(temperature=1.2, top_a=0.1, min_p=0.02),
    dict(temperature=1.0, eta_cutoff=5.0, epsilon_cutoff=3.0),
    dict(temperature=1.0, smoothing_factor=0.3, smoothing_curve=1.5),
    dict(dynatemp_min=0.5, dynatemp_max=1.5, dynatemp_exponent=1.5),
    dict(temperature=0.7, nsigma=1.0, skew=0.3),
    dict(temperature=1.0, no_repeat_ngram_size=2, repetition_penalty=1.2, repetition_penalty_range=20),
    dict(temperature=0.6, temperature_last=True, min_p=0.1),
    dict(temperature=1.0, sampler_priority=["xtc", "temperature", "min_p"], xtc_probability=0.3, min_p=0.05),
    dict(temperature=1.0, dry_multiplier=1.0, dry_allowed_length=1, presence_penalty=0.5),
    dict(temperature=1.0),
]


def test_64_mixed_seeded_requests_match_each_alone() -> None:
    vocab, steps = 400, 8
    params = [SamplingParams(seed=1000 + i, **MIXED[i % len(MIXED)]) for i in range(64)]
    prompts = [[(7 * i + j) % 50 + 1 for j in range(5 + i % 7)] for i in range(64)]
    logits = torch.randn(steps, 64, vocab, generator=torch.Generator().manual_seed(8)) * 2.5

    def generate(rows: list[int]) -> list[list[int]]:
        states = [make_state(params[r].clone(), prompts[r]) for r in rows]
        sampler = Sampler()
        for step in range(steps):
            meta = SamplingMetadata.build(states, vocab, CPU)
            sampled = sampler(logits[step, rows], meta).sampled_token_ids.tolist()
            for state, token in zip(states, sampled):
                state.output_token_ids.append(token)
        return [s.output_token_ids for s in states]

    batched = generate(list(range(64)))
    alone = [generate([r])[0] for r in range(64)]
    assert batched == alone
    assert len({tuple(t) for t in batched}) > 60
