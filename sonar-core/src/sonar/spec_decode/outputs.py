"""A verify step's several tokens, taken by the frontend as plain decoding would take them."""

from __future__ import annotations

from sonar.engine.detokenizer import IncrementalDetokenizer
from sonar.engine.scheduler_output import RequestLogprobs
from sonar.spec_decode.stats import truncated_logprobs


def append_until_stop(
    detokenizer: IncrementalDetokenizer, token_ids: list[int], logprobs: RequestLogprobs | None
) -> tuple[list[int], RequestLogprobs | None, str | None]:
    """Feed ``token_ids`` to ``detokenizer`` one at a time, stopping at the token that
    completes a stop string; returns the tokens kept, their logprobs and the stop string
    (None: no stop string matched, every token kept)."""
    for count, token_id in enumerate(token_ids, start=1):
        stop = detokenizer.append([token_id])
        if stop is not None:
            return token_ids[:count], truncated_logprobs(logprobs, count), stop
    return token_ids, logprobs, None
