"""The n-gram proposer: which span of a sequence it proposes, and what it costs per request."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sonar.spec_decode import ProposerInputs, SpeculativeConfig
from sonar.spec_decode.ngram import NgramProposer, ngram_lookup


def lookup(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 4) -> list[int]:
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: matched in full at the start; [3] alone occurs later too
    assert lookup([1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]) == [10, 11, 3, 20]


def test_among_equally_long_matches_the_most_recent_wins():
    assert lookup([5, 6, 7, 8, 5, 6, 9, 9, 5, 6], max_n=2) == [9, 9, 5, 6]


def test_drafts_stop_at_k_and_at_the_end_of_the_sequence():
    assert lookup([1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]
    assert lookup([7, 8, 7], k=4) == [8, 7]  # the match runs into the suffix itself


def test_no_draft_without_a_match_of_prompt_lookup_min_tokens():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([1, 2, 9, 2], min_n=2) == []  # only [2] recurs
    assert lookup([1, 2, 9, 1, 2], min_n=2) == [9, 1, 2]
    assert lookup([4]) == []


def test_proposer_reads_its_bounds_and_caps_drafts_at_num_speculative_tokens():
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=4)
    proposer = NgramProposer(config, torch.device("cpu"))
    drafts = proposer.propose(ProposerInputs(["a", "b"], [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3]], [1, 1]))
    assert drafts.req_ids == ["a", "b"] and drafts.token_ids == [[3, 4], []]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(SpeculativeConfig("ngram", 2, prompt_lookup_min=3, prompt_lookup_max=2), torch.device("cpu"))


def test_lookup_costs_well_under_a_millisecond_per_request_at_4k_tokens():
    rng = np.random.default_rng(0)
    sequence = rng.integers(0, 200, 4096)  # a small alphabet: many candidate matches
    lookup(list(sequence))
    started = time.perf_counter()
    for _ in range(50):
        ngram_lookup(sequence, 1, 3, 4)
    per_request_s = (time.perf_counter() - started) / 50
    print(f"ngram lookup: {per_request_s * 1e6:.0f} us per request at 4,096 tokens")
    assert per_request_s < 1e-3


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: longest suffix first, then its latest earlier end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[length - n :]:
                return tokens[end + 1 : end + 1 + k]
    return []


@pytest.mark.parametrize("alphabet", [2, 3, 7, 300, 70000])
def test_lookup_agrees_with_the_definition_on_random_sequences(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(300):
        tokens = rng.integers(0, alphabet, int(rng.integers(1, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        assert lookup(tokens, min_n, max_n, k) == _reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_byte_matches_across_token_boundaries_are_not_matches():
    # as int32 bytes, 256 = 00 01 00 00 and 1 = 01 00 00 00: "... 0, 1 | 0, 0 ..." holds the bytes
    # of a 256 at an offset that is not a token's start
    tokens = [256, 5, 0, 1, 0, 9, 7, 256]
    assert lookup(tokens, 1, 1, 2) == _reference(tokens, 1, 1, 2) == [5, 0]


def test_the_proposer_follows_a_growing_sequence_and_a_shorter_one_after_it():
    config = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
    proposer = NgramProposer(config, torch.device("cpu"))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, 40).tolist()
    for length in [*range(2, 40, 3), 7, 39]:  # grows step by step, then restarts shorter
        drafts = proposer.propose(ProposerInputs(["a"], [tokens[:length]], [1])).token_ids[0]
        assert drafts == _reference(tokens[:length], 1, 3, 3)


def test_the_device_lookup_drafts_what_the_host_lookup_drafts() -> None:
    """``ngram_lookup_on_device`` (the drafts of passes queued on the device) against the host
    lookup on random sequences of small vocabularies (many recurring n-grams), whatever the
    buffer holds past the sequence's length."""
    import random

    from sonar.spec_decode.ngram import ngram_lookup_on_device

    rng = random.Random(0)
    for _ in range(1500):
        vocab = rng.choice([2, 3, 5, 20])
        length = rng.randint(1, 60)
        sequence = [rng.randrange(vocab) for _ in range(length)]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 8)
        buffer = torch.randint(0, vocab, (64,))
        buffer[:length] = torch.tensor(sequence)
        drafts, count = ngram_lookup_on_device(buffer, torch.tensor(length), min_n, max_n, k)
        expected = ngram_lookup(np.array(sequence), min_n, max_n, k)
        assert drafts[: int(count)].tolist() == expected, (sequence, min_n, max_n, k)
        assert not drafts[int(count) :].any()
