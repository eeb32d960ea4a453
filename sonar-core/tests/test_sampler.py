"""Sampler stages against plain per-request references on random logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sonar.sampler import LogitsProcessor, RequestSamplingState, Sampler, SamplingMetadata, compute_logprobs
from sonar.sampling_params import SamplingParams

VOCAB = 200
EOS = 7


def make_state(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> RequestSamplingState:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return RequestSamplingState(
        params=params,
        prompt_token_ids=list(prompt or [1, 2, 3]),
        output_token_ids=list(output or []),
        generator=generator,
        eos_token_ids=[EOS],
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def sampler_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    meta = SamplingMetadata.build([make_state(p) for p in params], logits.shape[1], torch.device("cpu"))
    return Sampler().probabilities(logits.clone(), meta)


# --- per-request reference ----------------------------------------------------------------------


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Plain float64 top-k → top-p → min-p on one row, renormalised."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[:] = False
        keep[probs.topk(min(p.top_k, len(probs))).indices] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        order = probs.argsort(descending=True)
        mass_before = 0.0
        nucleus = torch.zeros_like(keep)
        for token in order.tolist():
            if mass_before >= p.top_p:
                break
            nucleus[token] = True
            mass_before += probs[token].item()
        keep &= nucleus
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


TRUNCATIONS = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.5, top_p=0.95),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=2.0, top_k=VOCAB + 10),
]


@pytest.mark.parametrize("params", TRUNCATIONS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_truncation_alone_matches_reference(params: SamplingParams) -> None:
    logits = random_logits(6, seed=1)
    probs = sampler_probs(logits, [params] * 6)
    for row in range(6):
        expected = reference_probs(logits[row], params)
        assert torch.equal(probs[row] > 0, expected > 0), f"kept set differs on row {row}"
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)


def test_truncation_mixed_batch_matches_reference() -> None:
    # every row has its own options; the batch shares one sort
    params = TRUNCATIONS * 3
    logits = random_logits(len(params), seed=2)
    probs = sampler_probs(logits, params)
    for row, p in enumerate(params):
        expected = reference_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, expected > 0), f"kept set differs on row {row} ({p})"
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)


def test_top_k_sizes_the_kept_set() -> None:
    logits = random_logits(4, seed=3)
    probs = sampler_probs(logits, [SamplingParams(top_k=k) for k in (1, 3, 17, 0)])
    assert (probs > 0).sum(dim=-1).tolist() == [1, 3, 17, VOCAB]


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(8, seed=4)
    before = logits.clone()
    meta = SamplingMetadata.build([make_state(SamplingParams(temperature=0.0))] * 8, VOCAB, torch.device("cpu"))
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = random_logits(10, seed=5)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=3, top_p=0.9) for i in range(10)]
    states = [make_state(p) for p in params]
    before = logits.clone()
    out = Sampler()(logits, SamplingMetadata.build(states, VOCAB, torch.device("cpu")))
    assert torch.equal(logits, before)
    sampled = out.sampled_token_ids.tolist()
    for row in range(10):
        if row % 2:
            assert sampled[row] == logits[row].argmax().item()
        else:
            assert sampled[row] in logits[row].topk(3).indices.tolist()


def test_unused_stages_are_skipped() -> None:
    meta = SamplingMetadata.build(
        [make_state(SamplingParams(temperature=0.0)), make_state(SamplingParams(temperature=0.0, top_k=5))],
        VOCAB,
        torch.device("cpu"),
    )
    assert meta.all_greedy and not meta.edits_logits
    skippable = set(SamplingMetadata.__dataclass_fields__) - {
        "num_rows", "all_greedy", "all_random", "generators", "max_top_k", "processor_rows", "order_groups", "states"
    }
    assert {name: getattr(meta, name) for name in skippable} == dict.fromkeys(skippable)


# --- penalties, bias, min_tokens ------------------------------------------------------------------


def reference_penalised(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    row = row.clone()
    for token in set(prompt) | set(output):
        value = row[token].item()
        row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_penalties_match_reference_formula() -> None:
    gen = torch.Generator().manual_seed(6)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=0.8),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=-0.4, frequency_penalty=1.2),
        SamplingParams(temperature=0.0),
    ]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 1, 12, 8)]
    outputs = [torch.randint(0, 20, (n,), generator=gen).tolist() for n in (0, 30, 9, 25, 4)]
    states = [make_state(p, prompt, output) for p, prompt, output in zip(params, prompts, outputs)]
    logits = random_logits(len(params), seed=7)

    captured: list[torch.Tensor] = []

    class Capture(LogitsProcessor):
        def __call__(self, logits, rows, states):
            captured.append(logits.clone())
            return logits

    for p in params:
        p.logits_processors = ["capture"]
    meta = SamplingMetadata.build(states, VOCAB, torch.device("cpu"))
    out = Sampler({"capture": Capture()})(logits, meta)
    processed = captured[0]
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        expected = reference_penalised(logits[row], p, prompt, output)
        torch.testing.assert_close(processed[row], expected, atol=1e-5, rtol=1e-5)
        assert out.sampled_token_ids[row].item() == expected.argmax().item()


def test_logit_bias_is_added() -> None:
    logits = random_logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0, 5: 0.0}),
        SamplingParams(temperature=0.0),
    ]
    meta = SamplingMetadata.build([make_state(p) for p in params], VOCAB, torch.device("cpu"))
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    second = logits[1].clone()
    second[second.argmax()] -= 100.0
    assert sampled == [11, second.argmax().item(), logits[2].argmax().item()]


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 50.0  # eos dominates
    logits[:, 9] = 40.0  # then a stop token
    logits[:, 3] = 30.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    states = [
        make_state(params, output=[1]),  # below min_tokens: eos and 9 masked
        make_state(params, output=[1, 2, 4]),  # reached: eos allowed
        make_state(params.clone(ignore_eos=True), output=[1]),  # eos is no stop: stays allowed
        make_state(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[9], top_k=1)),
    ]
    meta = SamplingMetadata.build(states, VOCAB, torch.device("cpu"))
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [3, EOS, EOS, 3]


# --- seeds and statistics -----------------------------------------------------------------------


def run_steps(states: list[RequestSamplingState], logits_per_step: list[torch.Tensor]) -> list[list[int]]:
    sampler = Sampler()
    tokens: list[list[int]] = [[] for _ in states]
    for logits in logits_per_step:
        meta = SamplingMetadata.build(states, logits.shape[1], torch.device("cpu"))
        sampled = sampler(logits, meta).sampled_token_ids.tolist()
        for row, state in enumerate(states):
            state.output_token_ids.append(sampled[row])
            tokens[row].append(sampled[row])
    return tokens


@pytest.mark.parametrize(
    "seeded",
    [SamplingParams(temperature=1.0, seed=1234, top_p=0.95), SamplingParams(temperature=1.1, seed=99)],
    ids=["top_p", "plain"],
)
def test_seeded_request_is_identical_alone_and_in_a_batch(seeded: SamplingParams) -> None:
    steps = 6
    row_logits = [random_logits(1, seed=100 + s) * 0.3 for s in range(steps)]
    alone = run_steps([make_state(seeded)], row_logits)[0]
    assert len(set(alone)) > 1, "the draw should not be degenerate"

    # 16 mixed requests, the seeded one at row 9
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=10),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.6, top_p=0.5, logprobs=3, presence_penalty=0.5),
    ]
    params = [others[i % len(others)] for i in range(15)]
    params.insert(9, seeded)
    batch_logits = []
    for s in range(steps):
        logits = random_logits(16, seed=200 + s)
        logits[9] = row_logits[s][0]
        batch_logits.append(logits)
    in_batch = run_steps([make_state(p) for p in params], batch_logits)[9]
    assert in_batch == alone

    # and a fresh run with the same seed repeats itself
    assert run_steps([make_state(seeded)], row_logits)[0] == alone


def test_sampling_frequencies_match_probabilities() -> None:
    torch.manual_seed(0)
    vocab, draws = 12, 20000
    row = torch.randn(vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.97)
    expected = reference_probs(row, params)
    logits = row.expand(draws, vocab).contiguous()
    meta = SamplingMetadata.build([make_state(params)] * draws, vocab, torch.device("cpu"))
    sampled = Sampler()(logits, meta).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "sampled a token outside the kept set"
    kept = expected > 0
    expected_counts = expected[kept] * draws
    chi_square = (((counts[kept] - expected_counts) ** 2) / expected_counts).sum().item()
    dof = int(kept.sum()) - 1
    assert chi_square < dof + 6 * math.sqrt(2 * dof), f"chi-square {chi_square:.1f} too large for {dof} dof"


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_column0_is_the_sampled_token() -> None:
    logits = random_logits(6, seed=9)
    params = [
        SamplingParams(temperature=0.7, top_k=4, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0),
        SamplingParams(temperature=1.0, logprobs=5, logit_bias={3: 5.0}),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=1),
    ]
    meta = SamplingMetadata.build([make_state(p, output=[4, 4, 5]) for p in params], VOCAB, torch.device("cpu"))
    out = Sampler()(logits, meta)
    assert out.logprobs is not None
    ids, values, ranks = out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks
    assert ids.shape == values.shape == (6, 6) and ranks.shape == (6,)
    assert torch.equal(ids[:, 0], out.sampled_token_ids)

    raw = torch.log_softmax(logits.double(), dim=-1)
    for row in range(6):
        token = ids[row, 0].item()
        torch.testing.assert_close(values[row].double(), raw[row, ids[row]], atol=1e-5, rtol=1e-5)
        assert ranks[row].item() == int((raw[row] > raw[row, token]).sum()) + 1
        assert ids[row, 1:].tolist() == raw[row].topk(5).indices.tolist()


def test_compute_logprobs_for_prompt_targets() -> None:
    logits = random_logits(5, seed=10)
    targets = torch.tensor([0, 1, 2, 3, int(logits[4].argmax())])
    result = compute_logprobs(logits, targets, k=0)
    assert result.token_ids.shape == (5, 1)
    expected = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
    torch.testing.assert_close(result.logprobs, expected)
    assert result.ranks[4].item() == 1


# --- registered logits processors ----------------------------------------------------------------


class BanTokenZero(LogitsProcessor):
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, logits, rows, states):
        self.calls.append(rows)
        logits[:, 0] = float("-inf")
        return logits


def test_registered_logits_processor_applies_only_to_its_rows() -> None:
    from sonar import registry
    from sonar.hookspecs import hookimpl
    from sonar.plugins import get_plugin_manager

    processor = BanTokenZero()

    class Plugin:
        @hookimpl
        def sonar_register_logits_processors(self, register):
            register("ban_zero", lambda: processor)

    manager = get_plugin_manager()
    plugin = Plugin()
    manager.register(plugin, name="test-ban-zero")
    registry.clear_caches()
    try:
        logits = torch.zeros(3, VOCAB)
        logits[:, 0] = 10.0
        params = [
            SamplingParams(temperature=0.0, logits_processors=["ban_zero"]),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0, top_k=1, logits_processors=["ban_zero"]),
        ]
        meta = SamplingMetadata.build([make_state(p) for p in params], VOCAB, torch.device("cpu"))
        sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert sampled[1] == 0 and sampled[0] != 0 and sampled[2] != 0
        assert processor.calls == [[0, 2]]
    finally:
        manager.unregister(plugin)
        registry.clear_caches()


def test_unknown_logits_processor_names_the_registered_ones() -> None:
    meta = SamplingMetadata.build([make_state(SamplingParams(logits_processors=["nope"]))], VOCAB, torch.device("cpu"))
    with pytest.raises(ValueError, match="'nope' is not registered"):
        Sampler()(random_logits(1), meta)


def test_banned_ids_match_the_definition_on_random_contexts() -> None:
    """The per-request index of bad words (by each word's second-to-last token) bans exactly what
    comparing every word with the end of the context bans."""

    def by_definition(state: RequestSamplingState) -> list[int]:
        context = state.prompt_token_ids + state.output_token_ids
        banned = list(state.min_tokens_blocked_ids())
        for word in state.params.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or (len(context) >= len(prefix) and context[len(context) - len(prefix):] == prefix):
                banned.append(word[-1])
        return banned

    rng = random.Random(3)
    for _ in range(300):
        alphabet = rng.randint(2, 6)
        words = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 30))]
        params = SamplingParams(bad_words_token_ids=words, min_tokens=rng.choice([0, 3]), stop_token_ids=[1])
        state = RequestSamplingState(params, [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))], [], None, [0])
        for _ in range(rng.randint(0, 8)):
            assert set(state.banned_ids()) == set(by_definition(state))
            state.output_token_ids.append(rng.randrange(alphabet))
        assert set(state.banned_ids()) == set(by_definition(state))
