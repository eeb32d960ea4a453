"""Which requests may decode with drafts: those whose next-token distribution at each
verified position depends only on that position's logits.

Requests whose sampling keeps per-token state the verifier does not replay decode without
drafts (exactly as with speculation off): penalties (repetition, presence, frequency), DRY,
no-repeat-ngram, multi-token bad words, logits processors, structured output, stages that
read earlier tokens (all of them ``SamplingParams.reads_output_tokens``), mirostat (its mu
moves with every token), and a request still short of ``min_tokens`` (its stop tokens are
banned position by position).
"""

from __future__ import annotations

from sonar.sampling_params import SamplingParams


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request with ``params`` and this many output tokens may verify drafts."""
    return may_ever_speculate(params) and num_output_tokens >= params.min_tokens


def may_ever_speculate(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may verify drafts at some point of its output."""
    return not params.reads_output_tokens and params.mirostat_mode == 0
