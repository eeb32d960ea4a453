"""The orderable sampler stages and their ids (``SamplingParams.sampler_priority``).

The integer ids are Aphrodite's, so a ``sampler_priority`` list sent to Aphrodite works here;
stage names (``"temperature"``, ``"xtc"``, …) are accepted as well.
"""

from __future__ import annotations

import enum


class SamplerID(enum.IntEnum):
    """One orderable stage of the sampler."""

    TOP_P_TOP_K = 0
    TOP_A = 1
    MIN_P = 2
    TFS = 3
    TYPICAL_P = 4
    TEMPERATURE = 5  # static or dynamic temperature
    PENALTIES = 6  # repetition/presence/frequency; registered logits processors run right after
    DRY = 7
    NO_REPEAT_NGRAM = 8
    TOP_NSIGMA = 9
    ETA_CUTOFF = 10
    EPSILON_CUTOFF = 11
    QUADRATIC = 12  # smoothing factor and curve
    XTC = 13


DEFAULT_ORDER: tuple[SamplerID, ...] = (
    SamplerID.DRY,
    SamplerID.PENALTIES,
    SamplerID.NO_REPEAT_NGRAM,
    SamplerID.TEMPERATURE,
    SamplerID.TOP_NSIGMA,
    SamplerID.TOP_P_TOP_K,
    SamplerID.TOP_A,
    SamplerID.MIN_P,
    SamplerID.TFS,
    SamplerID.ETA_CUTOFF,
    SamplerID.EPSILON_CUTOFF,
    SamplerID.TYPICAL_P,
    SamplerID.QUADRATIC,
    SamplerID.XTC,
)

_NAMES: dict[str, SamplerID] = {member.name.lower(): member for member in SamplerID} | {
    "top_k": SamplerID.TOP_P_TOP_K,
    "top_p": SamplerID.TOP_P_TOP_K,
    "typical": SamplerID.TYPICAL_P,
    "repetition_penalty": SamplerID.PENALTIES,
    "nsigma": SamplerID.TOP_NSIGMA,
    "smoothing": SamplerID.QUADRATIC,
    "dynatemp": SamplerID.TEMPERATURE,
}


def parse_sampler_id(value: int | str) -> SamplerID:
    """An id (``5``) or a stage name (``"temperature"``) → ``SamplerID``; ValueError otherwise."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _NAMES:
            return _NAMES[key]
        if key.lstrip("-").isdigit():
            value = int(key)
        else:
            raise ValueError(f"unknown sampler {value!r}; known: {sorted(_NAMES)}")
    if isinstance(value, bool) or not isinstance(value, int) or value not in SamplerID._value2member_map_:
        raise ValueError(f"unknown sampler id {value!r}; ids are 0..{max(SamplerID)}")
    return SamplerID(value)


def resolve_order(priority: list[int] | None, temperature_last: bool) -> tuple[SamplerID, ...]:
    """The stage order of one request: its ``sampler_priority`` first, then the stages it did not
    list in the default order; with ``temperature_last`` temperature moves to the end."""
    if priority:
        listed = tuple(parse_sampler_id(p) for p in priority)
        order = listed + tuple(s for s in DEFAULT_ORDER if s not in listed)
    else:
        order = DEFAULT_ORDER
    if temperature_last:
        order = tuple(s for s in order if s != SamplerID.TEMPERATURE) + (SamplerID.TEMPERATURE,)
    return order
