"""Kobold's sampler fields → the engine's ``SamplingParams`` fields."""

from __future__ import annotations

from typing import Any

from sonar.sampling_params import SamplingParams, check_token_id_counts
from sonar.structured_output import GuidedDecodingParams

from sonar_server.errors import ApiError
from sonar_server.sampling import build_sampling_params
from sonar_server.surfaces.kobold.field_names import sampling_params_from_kobold
from sonar_server.surfaces.kobold.protocol import GenerateRequest


def _grammar(grammar: str | None) -> GuidedDecodingParams | None:
    if not grammar or not grammar.strip():
        return None
    try:
        return GuidedDecodingParams(grammar=grammar)
    except ValueError as exc:
        raise ApiError(400, f"grammar: {exc}") from exc


def kobold_sampling_params(body: GenerateRequest, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
    """Kobold's native sampler names (``rep_pen``, ``typical``, ``dry_*``, ``sampler_order``,
    ...) through the Kobold field mapping; ``max_tokens`` is the caller's clamped
    ``max_length``; with ``vocab_size``, token-id lists and ``logit_bias`` longer than the
    vocabulary are a 400 before anything walks them."""
    fields = dict(body)  # the body's fields and extra fields, as sent (not copied entry by entry)
    try:
        if vocab_size is not None:
            check_token_id_counts(fields, vocab_size)
        mapped: dict[str, Any] = sampling_params_from_kobold(fields)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    mapped["max_tokens"] = max_tokens
    if body.ban_eos_token or body.bypass_eos:
        mapped["ignore_eos"] = True
    if not body.trim_stop:
        mapped["include_stop_str_in_output"] = True
    mapped["guided_decoding"] = _grammar(body.grammar)
    return build_sampling_params(body, mapped, vocab_size=vocab_size)
