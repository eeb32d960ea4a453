"""The work between two verify passes of a drafter in two launches (``DrafterPassChain``)
against the same work as separate device operations (``PassChain``), on random states:
passes that keep some, all or none of their drafts, stop tokens, the step's last rows,
``max_tokens``, passes that no longer run; and what the drafter reads after each (the rows
kept, the last token emitted and its position). On the GPU where present, else through
Triton's interpreter."""

from __future__ import annotations

import random

import torch

from sonar.spec_decode.device_passes import PassChain, PassRows
from sonar_cuda.kernels.drafter_passes import DrafterPassChain

BLOCK_SIZE = 4


def _rows(width: int, device: torch.device) -> PassRows:
    tokens = torch.full((3, width + 3), -7, dtype=torch.int64, device=device)
    return PassRows(tokens[0, :width], tokens[1, :width], tokens[2, :width], torch.full((width,), -7, dtype=torch.int32, device=device))


def test_two_launches_between_passes_do_what_the_separate_operations_do(device: torch.device) -> None:
    rng = random.Random(0)
    capacity = 96
    for trial in range(60):
        k = rng.choice([1, 3, 4, 7])
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
        outputs = []
        for cls in (PassChain, DrafterPassChain):
            chain = cls(capacity, k, 4, device)
            chain.begin(sequence, end, 0, max_tokens, stops, block_row, BLOCK_SIZE, first_drafts)
            rows = _rows(k + 1, device)
            seen = []
            chain.settle(greedy, inputs)
            for index in range(2):
                anchor, position = chain.anchor()
                seen.append([int(chain.kept_rows), int(anchor), int(position)])
                drafts = torch.randint(0, vocab, (k,), generator=torch.Generator().manual_seed(trial * 7 + index)).to(device)
                chain.lay_out(rows, drafts, k)
                # the target keeps a random prefix of the drafts laid out
                laid_out = rows.token_ids.clone()
                target = torch.roll(laid_out, -1)
                cut = (trial + index) % (k + 1)
                target[cut:] = (target[cut:] + 1) % vocab
                chain.settle(target, laid_out)
            anchor, position = chain.anchor()
            seen.append([int(chain.kept_rows), int(anchor), int(position)])
            done = chain.finish()
            outputs.append((done.read(), seen, [t.tolist() for t in (rows.token_ids, rows.positions, rows.slots, rows.seq_lens)],
                            chain.state.tolist(), chain.sequence[:capacity].tolist()))  # fmt: skip
        assert outputs[0] == outputs[1], (trial, sequence, k, end, max_tokens, stops)
