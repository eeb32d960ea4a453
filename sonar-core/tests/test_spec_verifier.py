"""The verifier alone, on synthetic distributions: greedy acceptance, and that sampled output
is distributed exactly as the target's (many samples, enough to see a 2% shift)."""

from __future__ import annotations

import torch

from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata
from sonar.sampler.sampler import Sampler
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.verifier import VerifyLayout, verify

CPU = torch.device("cpu")
NUM_SAMPLES = 60_000  # std of a frequency <= 0.002: a 2% shift is ten of them
TOLERANCE = 0.01


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / max(len(tokens), 1)


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_adds_the_targets_token():
    vocab = 8
    drafts = [[3, 4, 5], [1], []]
    layout = VerifyLayout.build(drafts, CPU)
    targets = torch.tensor([3, 4, 6, 2, 1, 0, 7])  # request 0: two kept then 6; request 1: kept, bonus 0; request 2: 7
    result = verify(None, targets, None, layout, {})
    assert result.num_accepted.tolist() == [2, 1, 0]
    emitted = [result.token_ids[s : s + a + 1].tolist() for s, a in zip(layout.starts, result.num_accepted.tolist())]
    assert emitted == [[3, 4, 6], [1, 0], [7]]
    assert vocab > max(targets.tolist())


def _sampled_run(p: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``NUM_SAMPLES`` requests with ``k`` drafts each against per-position targets ``p`` [k+1, V]."""
    num_drafts = drafts.shape[1]
    layout = VerifyLayout.build(drafts.tolist(), CPU)
    probs = p.repeat(NUM_SAMPLES, 1)
    q = None if draft_probs is None else draft_probs.repeat(NUM_SAMPLES, 1)
    result = verify(probs, None, None, layout, {}, q)
    return result.token_ids.view(NUM_SAMPLES, num_drafts + 1), result.num_accepted


def _target(vocab: int, seed: int) -> torch.Tensor:
    """A target distribution from the sampler's own pipeline (temperature, top-k, top-p)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=generator) * 2
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
    state = RequestSamplingState(params, [1], [], None, [])
    return Sampler().probabilities(logits, SamplingMetadata.build([state], vocab, CPU))[0]


def test_one_hot_drafts_leave_the_first_and_second_tokens_distributed_as_the_target():
    torch.manual_seed(0)
    vocab = 8
    p = torch.stack([_target(vocab, 1), _target(vocab, 2), _target(vocab, 3)])  # two drafts + bonus
    # drafts as n-gram gives them: fixed tokens, one likely at position 0, a mixed bag at 1
    likely = int(p[0].argmax())
    second = torch.randint(0, vocab, (NUM_SAMPLES,))
    drafts = torch.stack([torch.full((NUM_SAMPLES,), likely), second], dim=1)
    tokens, num_accepted = _sampled_run(p, drafts, None)
    assert (frequencies(tokens[:, 0], vocab) - p[0].double()).abs().max() < TOLERANCE
    # the second token, among requests whose first draft was kept, follows p[1] whatever was drafted
    kept = num_accepted >= 1
    assert (frequencies(tokens[kept, 1], vocab) - p[1].double()).abs().max() < TOLERANCE
    # the bonus token, where both drafts were kept, follows p[2]
    both = num_accepted == 2
    assert both.sum() > 1000
    assert (frequencies(tokens[both, 2], vocab) - p[2].double()).abs().max() < 2 * TOLERANCE
    # a draft is kept with probability p(draft)
    assert abs(kept.double().mean().item() - p[0, likely].item()) < TOLERANCE


def test_drafts_sampled_from_a_draft_distribution_are_corrected_to_the_target():
    torch.manual_seed(1)
    vocab = 6
    p = torch.stack([_target(vocab, 4), _target(vocab, 5)])
    q0 = torch.softmax(torch.randn(vocab), dim=0)  # a draft model that disagrees with the target
    drafts = torch.multinomial(q0, NUM_SAMPLES, replacement=True)[:, None]
    draft_probs = torch.stack([q0, torch.zeros(vocab)])  # the bonus row is not read
    tokens, _ = _sampled_run(p, drafts, draft_probs)
    assert (frequencies(tokens[:, 0], vocab) - p[0].double()).abs().max() < TOLERANCE


def test_seeded_generators_make_verification_reproducible():
    p = torch.stack([_target(8, 6), _target(8, 7)])
    layout = VerifyLayout.build([[int(p[0].argmax())]] * 4, CPU)

    def run() -> list[int]:
        generators = {row: torch.Generator().manual_seed(100 + row) for row in range(4)}
        return verify(p.repeat(4, 1), None, None, layout, generators).token_ids.tolist()

    assert run() == run()
