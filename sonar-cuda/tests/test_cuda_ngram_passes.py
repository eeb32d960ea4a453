"""The work between two n-gram verify passes in one launch (``NgramPassChain.advance``)
against the same work as separate device operations (``PassChain.advance``), on random
states: passes that keep some, all or none of their drafts, stop tokens, the step's last rows,
``max_tokens``, passes that no longer run. On the GPU where present, else through Triton's
interpreter."""

from __future__ import annotations

import random

import torch

from sonar.spec_decode.device_passes import PassChain, PassRows
from sonar.spec_decode.interface import SpeculativeConfig
from sonar.spec_decode.ngram import NgramProposer
from sonar_cuda.kernels.ngram_passes import NgramPassChain

BLOCK_SIZE = 4


def _rows(width: int, device: torch.device) -> PassRows:
    tokens = torch.full((3, width + 3), -7, dtype=torch.int64, device=device)
    return PassRows(tokens[0, :width], tokens[1, :width], tokens[2, :width], torch.full((width,), -7, dtype=torch.int32, device=device))


def random_first_pass(rng: random.Random, k: int, capacity: int, device: torch.device) -> tuple:
    """A random request and the first pass of its step: the vocabulary's size, its sequence,
    the step's end, ``max_tokens``, stop tokens, its block-table row, the pass's drafts and
    its input ids and target tokens (agreeing with a random prefix of the drafts)."""
    vocab = rng.choice([3, 6])
    length = rng.randint(2, 40)
    sequence = [rng.randrange(vocab) for _ in range(length)]
    end = length - 1 + rng.randint(1, 3 * (k + 1))
    max_tokens = rng.choice([None, rng.randint(1, 30)])
    stops = set(rng.sample(range(vocab), rng.randint(0, 1)))
    block_row = torch.randperm(64, device=device)[: capacity // BLOCK_SIZE].to(torch.int32)
    first_drafts = rng.randint(0, k)
    inputs = torch.tensor([sequence[-1]] + [rng.randrange(vocab) for _ in range(first_drafts)], device=device)
    greedy = inputs.clone()
    agree = rng.randint(0, first_drafts)  # the target agrees with the first drafts, then not
    greedy[:agree] = inputs[1 : agree + 1]
    greedy[agree:] = torch.randint(0, vocab, (first_drafts + 1 - agree,), device=device)
    return vocab, sequence, end, max_tokens, stops, block_row, first_drafts, inputs, greedy


def test_one_launch_between_passes_does_what_the_separate_operations_do(device: torch.device) -> None:
    rng = random.Random(0)
    capacity = 96
    for trial in range(60):
        k = rng.choice([1, 3, 4, 7])
        min_n = rng.randint(1, 2)
        max_n = rng.randint(min_n, 4)
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
        proposer = NgramProposer(config, device)
        vocab, sequence, end, max_tokens, stops, block_row, first_drafts, inputs, greedy = random_first_pass(rng, k, capacity, device)
        chains = [cls(capacity, k, 4, device) for cls in (PassChain, NgramPassChain)]
        outputs = []
        for chain in chains:
            chain.begin(sequence, end, 0, max_tokens, stops, block_row, BLOCK_SIZE, first_drafts)
            rows = _rows(k + 1, device)
            chain.advance(greedy, inputs, rows, proposer)
            # a second pass whose target keeps a random prefix of the drafts laid out
            second = rows.token_ids.clone()
            target = torch.roll(second, -1)
            cut = trial % (k + 1)
            target[cut:] = (target[cut:] + 1) % vocab
            chain.advance(target, rows.token_ids.clone(), rows, proposer)
            chain.settle(torch.randint(0, vocab, (k + 1,), generator=torch.Generator().manual_seed(trial)).to(device), rows.token_ids.clone())
            done = chain.finish()
            outputs.append((done.read(), [t.tolist() for t in (rows.token_ids, rows.positions, rows.slots, rows.seq_lens)],
                            chain.state.tolist(), chain.sequence[:capacity].tolist()))  # fmt: skip
        assert outputs[0] == outputs[1], (trial, sequence, k, min_n, max_n, end, max_tokens, stops)
