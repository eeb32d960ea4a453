"""Sampling parameters at the edges of what validation accepts: no NaN reaches the draw, a
masked token is never sampled, and numbers float32 cannot hold are refused."""

from __future__ import annotations

import math

import pytest
import torch
from sonar.sampler import RequestSamplingState, Sampler, SamplingMetadata
from sonar.sampler.metadata import LOGIT_BIAS_LIMIT
from sonar.sampling_params import FLOAT32_MAX, SamplingParams

VOCAB = 64
MASKED = range(10, 20)  # -inf in the model's logits
EXTREMES = [0.0, 1e-38, 1e-300, 1e-4, 1e4, 1e30, FLOAT32_MAX, -1e30, -FLOAT32_MAX]
FLOAT_FIELDS = [
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "dry_multiplier",
    "dry_base", "xtc_threshold", "xtc_probability", "typical_p", "tfs", "top_a", "eta_cutoff", "epsilon_cutoff", "nsigma",
    "smoothing_factor", "smoothing_curve", "dynatemp_min", "dynatemp_max", "dynatemp_exponent", "skew",
]  # fmt: skip


def _combinations() -> list[dict]:
    combos = [{name: value} for name in FLOAT_FIELDS for value in EXTREMES]
    for v in EXTREMES:
        combos += [
            {"smoothing_factor": 1.0, "smoothing_curve": v},
            {"smoothing_factor": v, "smoothing_curve": 1e30},
            {"dynatemp_max": v, "dynatemp_exponent": 1.0},
            {"dynatemp_max": 1.0, "dynatemp_exponent": v},
            {"mirostat_mode": 2, "mirostat_tau": v},
            {"mirostat_mode": 2, "mirostat_eta": v},
            {"logit_bias": {1: v, 2: v}, "temperature": 1e-4},
            {"logit_bias": {1: v, 2: v}, "repetition_penalty": 1e-3},
            {"logit_bias": {1: v}, "temperature": 0.5, "smoothing_factor": 1.0},
            {"dry_multiplier": 1.0, "dry_base": v, "dry_allowed_length": 1},
            {"temperature": v, "top_p": 0.5},
            {"temperature": 0.7, "skew": v},
        ]
    return combos


def _valid(kwargs: dict) -> SamplingParams | None:
    try:
        return SamplingParams(max_tokens=4, **kwargs)
    except ValueError:
        return None


def test_extreme_accepted_parameters_never_give_a_nan_distribution_or_a_masked_token():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 5
    logits[0, MASKED.start : MASKED.stop] = -math.inf
    sampler = Sampler()
    checked = 0
    for kwargs in _combinations():
        params = _valid(kwargs)
        if params is None:
            continue
        checked += 1
        state = RequestSamplingState(params, [1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2], None, [0])
        meta = SamplingMetadata.build([state], VOCAB, torch.device("cpu"))
        processed = sampler.process(logits.clone(), meta)
        assert not torch.softmax(processed, dim=-1).isnan().any(), kwargs
        token = int(sampler(logits.clone(), meta).sampled_token_ids[0])
        assert 0 <= token < VOCAB and token not in MASKED, (kwargs, token)
    assert checked > 150  # most of the combinations are valid: the loop is not vacuous


@pytest.mark.parametrize("kwargs", [{"temperature": 1e308}, {"smoothing_factor": 1e39}, {"dynatemp_max": -1e300}, {"logit_bias": {5: 1e300}}])
def test_numbers_float32_cannot_hold_are_refused(kwargs):
    with pytest.raises(ValueError, match="float32"):
        SamplingParams(**kwargs)


def test_a_logit_bias_past_100_is_applied_as_100():
    state = RequestSamplingState(SamplingParams(logit_bias={3: 1e30, 4: -1e30, 5: 7.5}), [1], [], None, [0])
    ids, biases = state.logit_bias_tensors(VOCAB)
    assert ids.tolist() == [3, 4, 5]
    assert biases.tolist() == [LOGIT_BIAS_LIMIT, -LOGIT_BIAS_LIMIT, 7.5]
