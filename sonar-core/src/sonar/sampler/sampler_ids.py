"""The integer ids of Sonar's own orderable stages in ``SamplingParams.sampler_priority``.

They are Aphrodite's, so a ``sampler_priority`` list sent to Aphrodite works here; stage names
(``"temperature"``, ``"xtc"``, …, and those of plugins' stages) are accepted as well (see
``sonar.sampler.stage_table.StageTable.lookup``).
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

