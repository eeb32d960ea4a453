"""Rejection sampling against a drafter's real distributions (q far from one-hot, at every
draft position), and how the proposer's distributions are laid out row for row beside the
target's positions."""

from __future__ import annotations

import torch
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata
from sonar.sampler.sampler import Sampler
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.draft_probs import DraftProbsStore
from sonar.spec_decode.verifier import VerifyLayout, verify

CPU = torch.device("cpu")
NUM_SAMPLES = 60_000  # std of a frequency <= 0.002: a 2% shift is ten of them
TOLERANCE = 0.01


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / max(len(tokens), 1)


def distribution(vocab: int, seed: int, params: SamplingParams) -> torch.Tensor:
    """A distribution from the sampler's own pipeline, as a drafter's or the target's would be."""
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    state = RequestSamplingState(params, [1], [], None, [])
    return Sampler().probabilities(logits, SamplingMetadata.build([state], vocab, CPU))[0]


def test_two_positions_drafted_from_q_come_out_distributed_as_p_and_kept_at_the_overlap_rate():
    torch.manual_seed(3)
    vocab = 7
    target = SamplingParams(temperature=0.9, top_k=6)
    drafter = SamplingParams(temperature=1.3)  # the same logits, broader and untruncated: q != p everywhere
    p = torch.stack([distribution(vocab, seed, target) for seed in (10, 11, 12)])  # two drafts + bonus
    q = torch.stack([distribution(vocab, seed, drafter) for seed in (10, 11)])
    drafts = torch.stack([torch.multinomial(q[j], NUM_SAMPLES, replacement=True) for j in range(2)], dim=1)
    layout = VerifyLayout.build(drafts.tolist(), CPU)
    q_rows = torch.cat([q, torch.zeros(1, vocab)]).repeat(NUM_SAMPLES, 1)  # the bonus row is not read
    result = verify(p.repeat(NUM_SAMPLES, 1), None, None, layout, {}, q_rows)
    tokens = result.token_ids.view(NUM_SAMPLES, 3)
    num_accepted = result.num_accepted
    # a draft is kept with probability sum_x min(p(x), q(x))
    overlap = torch.minimum(p[0], q[0]).sum().item()
    assert abs((num_accepted >= 1).double().mean().item() - overlap) < TOLERANCE
    # each emitted token follows the target, whatever was drafted
    assert (frequencies(tokens[:, 0], vocab) - p[0].double()).abs().max() < TOLERANCE
    kept = num_accepted >= 1
    assert (frequencies(tokens[kept, 1], vocab) - p[1].double()).abs().max() < TOLERANCE
    both = num_accepted == 2
    assert both.sum() > 30_000
    assert (frequencies(tokens[both, 2], vocab) - p[2].double()).abs().max() < TOLERANCE


def test_equal_draft_and_target_distributions_keep_every_draft():
    vocab = 9
    p = distribution(vocab, 5, SamplingParams(temperature=0.7))
    drafts = torch.multinomial(p, 2000, replacement=True)[:, None]
    layout = VerifyLayout.build(drafts.tolist(), CPU)
    rows = torch.stack([p, torch.zeros(vocab)]).repeat(2000, 1)
    result = verify(torch.stack([p, p]).repeat(2000, 1), None, None, layout, {}, rows)
    assert result.num_accepted.sum().item() == 2000


def test_stored_distributions_line_up_with_the_verified_drafts():
    vocab = 5
    store = DraftProbsStore()
    probs_a = torch.softmax(torch.randn(3, vocab), dim=-1)
    probs_c = torch.softmax(torch.randn(2, vocab), dim=-1)
    store.store("a", [1, 2, 3], probs_a)
    store.store("b", [4], None)  # drafted greedily: nothing kept
    store.store("c", [0, 0], probs_c)
    store.store("d", [2, 2], torch.softmax(torch.randn(2, vocab), dim=-1))
    # the scheduler verifies a's first two drafts only; b's greedy draft; none of c; d's drafts changed
    drafts = [[1, 2], [4], [], [3, 1]]
    layout = VerifyLayout.build(drafts, CPU)
    rows = store.take_rows(["a", "b", "c", "d"], drafts, layout, vocab)
    assert rows.shape == (layout.num_positions, vocab) == (3 + 2 + 1 + 3, vocab)
    assert torch.equal(rows[0:2], probs_a[:2])
    assert rows[2].sum() == 0  # a's bonus position
    assert rows[3].tolist() == [0, 0, 0, 0, 1.0]  # b: one-hot at its draft
    assert rows[5].sum() == 0  # c verified nothing
    assert rows[6].tolist() == [0, 0, 0, 1.0, 0] and rows[7].tolist() == [0, 1.0, 0, 0, 0]  # d: not its stored drafts
    assert not store  # each entry is used once
    assert store.take_rows(["a"], [[1]], VerifyLayout.build([[1]], CPU), vocab) is None
