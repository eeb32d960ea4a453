"""The block drafter's training logits agree with the logits it drafts from."""

import pytest
import torch
from transformers import LlamaConfig

from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter

VOCAB, HIDDEN = 97, 32


def _drafter(kind: str | None) -> DFlashDrafter:
    target = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    config = drafter_config_for(target, "deepspec", 5, 1, [1], VOCAB - 1, markov_rank=8 if kind else 0, markov_head_type=kind, confidence_head=kind is not None)
    drafter = init_drafter(DFlashDrafter(config), std=0.2, seed=1)
    if drafter.markov_head is not None:
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.normal_(0, 0.5)  # a Markov bias that changes the picks
    return drafter


@pytest.mark.parametrize("kind", [None, "vanilla", "gated", "rnn"])
def test_teacher_forced_logits_are_the_drafting_logits_given_the_same_tokens_before(kind):
    torch.manual_seed(0)
    drafter = _drafter(kind)
    rows, slots = 6, 4
    hidden = torch.randn(rows, slots, HIDDEN)
    head = torch.randn(VOCAB, HIDDEN)
    anchors = torch.randint(0, VOCAB, (rows,))
    base = hidden @ head.T
    with torch.no_grad():
        drafts, before = drafter.pick_greedy(base, hidden, anchors)
        forced = drafter.teacher_forced_logits(hidden, head, before)
    # drafting picks each slot's argmax of the forced logits, the drafts before it given
    assert torch.equal(forced.argmax(dim=-1), drafts)
    assert torch.equal(before[:, 0], anchors) and torch.equal(before[:, 1:], drafts[:, :-1])
    if kind is None:
        torch.testing.assert_close(forced, base)
    else:
        assert not torch.equal(forced.argmax(dim=-1), base.argmax(dim=-1))  # the Markov bias mattered
    assert forced.dtype == torch.float32 and forced.shape == (rows, slots, VOCAB)


def test_the_fused_markov_product_equals_the_head_plus_the_bias():
    torch.manual_seed(0)
    drafter = _drafter("vanilla")
    hidden, head = torch.randn(3, 4, HIDDEN), torch.randn(VOCAB, HIDDEN)
    prev = torch.randint(0, VOCAB, (3, 4))
    with torch.no_grad():
        expected = hidden @ head.T + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev))
        torch.testing.assert_close(drafter.teacher_forced_logits(hidden, head, prev), expected, rtol=1e-5, atol=1e-5)


def test_training_labels_stop_where_the_answer_leaves_the_greedy_chain():
    """A block's slot is labelled with the target's argmax only while the answer's tokens
    between the anchor and it are the greedy chain (as they are when drafting); after a
    sampled token that differs from the argmax, the later slots of blocks spanning it have none."""
    from sonar.spec_decode.dflash_trainer import _collate
    from sonar.spec_decode.eagle3_data import Sample

    config = _drafter(None).config  # deepspec layout, blocks of 5: slot j drafts anchor + j + 1
    prompt, length = 3, 14
    greedy = torch.arange(100, 100 + length)  # the argmax after each position
    tokens = [7, 8, 9] + [int(greedy[p - 1]) for p in range(prompt, length)]
    tokens[8] = 55  # a sampled token that is not the argmax after position 7
    sample = Sample(tokens, prompt, torch.zeros(length, HIDDEN), torch.zeros(length, HIDDEN))
    batch = _collate([sample], [greedy], config, num_anchors=100, gen=torch.Generator().manual_seed(0), device=torch.device("cpu"))
    anchors = list(range(prompt, length - 1))
    for row, anchor in enumerate(anchors):
        for j in range(config.num_drafts):
            target = anchor + j + 1
            crosses = anchor < 8 <= target - 1  # the off-chain token lies between the anchor and the slot
            expected = -1 if target >= length or crosses else int(greedy[target - 1])
            assert int(batch.labels[0, row, j]) == expected, (anchor, j)
