"""Kobold's sampler fields → the engine's ``SamplingParams`` fields."""

from __future__ import annotations

from typing import Any

from sonar.sampling_params import SamplingParams
from sonar.structured_output import GuidedDecodingParams

from sonar_server.errors import ApiError
from sonar_server.sampling import build_sampling_params, engine_sampling_fields
from sonar_server.surfaces.kobold.protocol import GenerateRequest

# Kobold name -> engine name, for samplers the engine may or may not have yet; a field whose
# engine name is not a SamplingParams field is ignored (Kobold clients send every sampler).
KOBOLD_TO_ENGINE = {
    "typical": "typical_p",
    "tfs": "tfs",
    "top_a": "top_a",
    "rep_pen_range": "repetition_penalty_range",
    "smoothing_factor": "smoothing_factor",
    "smoothing_curve": "smoothing_curve",
    "mirostat": "mirostat_mode",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_range",
    "dry_sequence_breakers": "dry_sequence_breakers",
    "xtc_threshold": "xtc_threshold",
    "xtc_probability": "xtc_probability",
    "nsigma": "top_nsigma",
    "dynatemp_exponent": "dynatemp_exponent",
    "sampler_order": "sampler_priority",
    "banned_tokens": "bad_words",
}


def _grammar(grammar: str | None) -> GuidedDecodingParams | None:
    if not grammar or not grammar.strip():
        return None
    try:
        return GuidedDecodingParams(grammar=grammar)
    except ValueError as exc:
        raise ApiError(400, f"grammar: {exc}") from exc


def kobold_sampling_params(body: GenerateRequest, max_tokens: int) -> SamplingParams:
    fields = engine_sampling_fields()
    extra = body.model_extra or {}
    mapped: dict[str, Any] = {
        "n": body.n,
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.rep_pen,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.sampler_seed if body.sampler_seed is not None and body.sampler_seed >= 0 else None,
        "stop": [s for s in body.stop_sequence or [] if s] or None,
        "ignore_eos": body.ban_eos_token or body.bypass_eos or None,
        "include_stop_str_in_output": (not body.trim_stop) or None,
        "guided_decoding": _grammar(body.grammar),
    }
    for kobold_name, engine_name in KOBOLD_TO_ENGINE.items():
        if kobold_name in extra and engine_name in fields:
            mapped[engine_name] = extra[kobold_name]
    dynatemp_range = extra.get("dynatemp_range")
    if dynatemp_range and {"dynatemp_min", "dynatemp_max"} <= fields:
        if not isinstance(dynatemp_range, (int, float)):
            raise ApiError(400, f"dynatemp_range must be a number, got {dynatemp_range!r}")
        temperature = body.temperature if body.temperature is not None else 1.0
        mapped["dynatemp_min"] = max(temperature - dynatemp_range, 0.0)
        mapped["dynatemp_max"] = temperature + dynatemp_range
    return build_sampling_params(body, mapped)
