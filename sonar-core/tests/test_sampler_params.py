"""The new sampling fields: validation messages name the field."""

from __future__ import annotations

import math

import pytest

from sonar.sampler.param_names import OPENAI_EXTRA_SAMPLING_FIELDS
from sonar.sampling_params import SamplingParams

INVALID = [
    ("xtc_probability", -0.1),
    ("xtc_threshold", 1.5),
    ("dry_multiplier", math.nan),
    ("dry_base", 0.5),
    ("dry_allowed_length", -1),
    ("dry_range", 2.5),
    ("mirostat_mode", 3),
    ("mirostat_tau", -1.0),
    ("mirostat_eta", math.inf),
    ("typical_p", 0.0),
    ("tfs", 1.2),
    ("top_a", -0.2),
    ("eta_cutoff", -1.0),
    ("epsilon_cutoff", 1e5),
    ("smoothing_factor", -1.0),
    ("smoothing_curve", 0.5),
    ("dynatemp_min", -0.1),
    ("dynatemp_exponent", math.nan),
    ("nsigma", -2.0),
    ("no_repeat_ngram_size", -3),
    ("skew", math.inf),
    ("temperature_last", "yes"),
    ("sampler_priority", [42]),
    ("allowed_token_ids", []),
    ("bad_words_token_ids", [[]]),
    ("repetition_penalty_range", -5),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_dynatemp_range_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="dynatemp_min"):
        SamplingParams(dynatemp_min=2.0, dynatemp_max=1.0)


def test_every_openai_extra_field_is_a_sampling_param() -> None:
    assert set(OPENAI_EXTRA_SAMPLING_FIELDS) <= set(SamplingParams.__dataclass_fields__)
