"""Kobold's native sampler names map onto the engine's ``SamplingParams``; errors name the Kobold field."""

from __future__ import annotations

import math

import pytest
from sonar.sampler.sampler_ids import SamplerID
from sonar.sampling_params import SamplingParams
from sonar_server.surfaces.kobold.field_names import sampling_params_from_kobold


def test_kobold_body_maps_onto_sampling_params() -> None:
    body = {
        "prompt": "Once upon a time", "max_length": 80, "temperature": 0.8, "rep_pen": 1.1,
        "rep_pen_range": 320, "rep_pen_slope": 0.7, "top_a": 0.1, "typical": 0.9, "tfs": 0.95,
        "top_k": 0, "top_p": 0.92, "min_p": 0.05, "dry_multiplier": 0.8, "dry_base": 1.75,
        "dry_allowed_length": 2, "dry_penalty_last_n": 512, "dry_sequence_breakers": ["\n", "*"],
        "xtc_threshold": 0.15, "xtc_probability": 0.5, "mirostat": 2, "mirostat_tau": 4.0,
        "mirostat_eta": 0.2, "dynatemp_range": 0.5, "dynatemp_exponent": 1.2,
        "smoothing_factor": 0.3, "smoothing_curve": 1.5, "nsigma": 1.0,
        "sampler_order": [6, 0, 1, 3, 4, 2, 5], "banned_tokens": ["darn"], "logit_bias": {"17": -5},
        "sampler_seed": -1, "stop_sequence": ["\nYou:", ""], "genkey": "abc",
    }  # fmt: skip
    kwargs = sampling_params_from_kobold(body)
    params = SamplingParams(**kwargs)
    assert params.max_tokens == 80 and params.repetition_penalty == 1.1
    assert params.repetition_penalty_range == 320 and params.repetition_penalty_slope == 0.7
    assert params.typical_p == 0.9 and params.dry_range == 512 and params.mirostat_mode == 2
    assert params.dynatemp_min == pytest.approx(0.3) and params.dynatemp_max == pytest.approx(1.3)
    assert params.bad_words == ["darn"] and params.logit_bias == {17: -5.0}
    assert params.seed is None and params.stop == ["\nYou:"]
    assert params.sampler_priority == [
        SamplerID.PENALTIES, SamplerID.TOP_P_TOP_K, SamplerID.TOP_A, SamplerID.TFS, SamplerID.TYPICAL_P, SamplerID.TEMPERATURE
    ]  # fmt: skip
    assert "prompt" not in kwargs and "genkey" not in kwargs


@pytest.mark.parametrize(
    "body,kobold_field",
    [({"rep_pen": -1.0}, "rep_pen"), ({"typical": 2.0}, "typical"), ({"xtc_probability": -0.5}, "xtc_probability"),
     ({"sampler_order": [0, 9]}, "sampler_order"), ({"dynatemp_range": math.nan}, "dynatemp_range"),
     ({"mirostat": 5}, "mirostat")],
)  # fmt: skip
def test_kobold_errors_name_the_kobold_field(body: dict, kobold_field: str) -> None:
    with pytest.raises(ValueError) as info:
        sampling_params_from_kobold(body)
    assert str(info.value).startswith(kobold_field)


def test_dry_penalty_last_n_minus_one_is_the_whole_context() -> None:
    assert sampling_params_from_kobold({"dry_multiplier": 0.8, "dry_penalty_last_n": -1})["dry_range"] == 0
    with pytest.raises(ValueError, match="dry_penalty_last_n"):
        SamplingParams(**sampling_params_from_kobold({"dry_multiplier": 0.8, "dry_penalty_last_n": -2}))
