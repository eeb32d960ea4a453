"""KoboldAI's native sampler field names (``rep_pen``, ``typical``, ``sampler_order``, ...)
mapped onto the engine's ``SamplingParams``."""

from __future__ import annotations

import math
from typing import Any

from sonar.sampler.sampler_ids import SamplerID
from sonar.sampling_params import SamplingParams

# Kobold name -> SamplingParams name, where only the name differs
KOBOLD_RENAMES: dict[str, str] = {
    "max_length": "max_tokens",
    "rep_pen": "repetition_penalty",
    "rep_pen_range": "repetition_penalty_range",
    "rep_pen_slope": "repetition_penalty_slope",
    "typical": "typical_p",
    "mirostat": "mirostat_mode",
    "dry_penalty_last_n": "dry_range",
    "stop_sequence": "stop",
    "banned_tokens": "bad_words",
    "sampler_order": "sampler_priority",
    "sampler_seed": "seed",
}
KOBOLD_SAME_NAMES: tuple[str, ...] = (
    "n", "temperature", "top_k", "top_p", "min_p", "top_a", "tfs", "presence_penalty",
    "frequency_penalty", "logit_bias", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_sequence_breakers", "xtc_threshold", "xtc_probability", "mirostat_tau", "mirostat_eta",
    "dynatemp_exponent", "smoothing_factor", "smoothing_curve", "nsigma", "min_tokens",
)  # fmt: skip

MAX_SAMPLER_ORDER = 64  # ids a sampler_order may list (Kobold has 7; repeats are read once)

# KoboldAI's sampler_order ids: 0 top-k, 1 top-a, 2 top-p, 3 tail-free, 4 typical,
# 5 temperature, 6 repetition penalty (top-k and top-p are one stage here)
KOBOLD_SAMPLER_ORDER: dict[int, SamplerID] = {
    0: SamplerID.TOP_P_TOP_K,
    1: SamplerID.TOP_A,
    2: SamplerID.TOP_P_TOP_K,
    3: SamplerID.TFS,
    4: SamplerID.TYPICAL_P,
    5: SamplerID.TEMPERATURE,
    6: SamplerID.PENALTIES,
}


def sampling_params_from_kobold(body: dict[str, Any]) -> dict[str, Any]:
    """KoboldAI generate-body fields → ``SamplingParams`` keyword arguments.

    Reads Kobold's native names (``rep_pen``, ``rep_pen_range``, ``rep_pen_slope``, ``typical``,
    ``tfs``, ``top_a``, ``dry_*``, ``xtc_*``, ``mirostat*``, ``dynatemp_range`` and
    ``dynatemp_exponent``, ``smoothing_*``, ``nsigma``, ``sampler_order``, ``banned_tokens``,
    ``logit_bias``, ``sampler_seed``, ``max_length``, ``stop_sequence``, …); other keys (prompt,
    memory, genkey, …) are left to the caller. ``None`` values are dropped. ``dynatemp_range``
    r > 0 becomes ``dynatemp_min = max(temperature - r, 0)``, ``dynatemp_max = temperature + r``;
    ``sampler_seed`` -1 means unseeded; ``dry_penalty_last_n`` -1 the whole context; ``sampler_order`` ids are translated to ``SamplerID``\\ s.

    :raises ValueError: an invalid value, with a message that starts with the Kobold field's
        name (the server answers it with a 400).
    """
    kwargs: dict[str, Any] = {}
    source: dict[str, str] = {}  # SamplingParams name -> Kobold name, for error messages
    for name in KOBOLD_SAME_NAMES:
        if body.get(name) is not None:
            kwargs[name], source[name] = body[name], name
    for kobold_name, name in KOBOLD_RENAMES.items():
        if body.get(kobold_name) is not None:
            kwargs[name], source[name] = body[kobold_name], kobold_name

    if kwargs.get("seed") is not None and isinstance(kwargs["seed"], int) and kwargs["seed"] < 0:
        del kwargs["seed"]
    if kwargs.get("dry_range") == -1 and not isinstance(kwargs["dry_range"], bool):  # llama.cpp's "the whole context"
        kwargs["dry_range"] = 0
    if "stop" in kwargs and isinstance(kwargs["stop"], list):
        kwargs["stop"] = [s for s in kwargs["stop"] if s]
    if "sampler_priority" in kwargs:
        kwargs["sampler_priority"] = _kobold_order(kwargs["sampler_priority"])
    if isinstance(kwargs.get("logit_bias"), dict):
        try:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past any float
            raise ValueError("logit_bias must map token ids to numbers") from None

    dynatemp_range = body.get("dynatemp_range")
    if dynatemp_range is not None:
        if isinstance(dynatemp_range, bool) or not isinstance(dynatemp_range, (int, float)) or not _finite(dynatemp_range) or dynatemp_range < 0:
            raise ValueError(f"dynatemp_range must be a finite number >= 0, got {dynatemp_range!r}")
        if dynatemp_range > 0:
            temperature = kwargs.get("temperature", 1.0)
            if isinstance(temperature, (int, float)):
                kwargs["dynatemp_min"] = max(temperature - dynatemp_range, 0.0)
                kwargs["dynatemp_max"] = temperature + dynatemp_range
                source["dynatemp_min"] = source["dynatemp_max"] = "dynatemp_range"

    try:
        SamplingParams(**kwargs)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(_rename_field(str(exc), source)) from None
    return kwargs


def _finite(value: int | float) -> bool:
    """Whether a number is finite as a float (an integer past any float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _kobold_order(order: Any) -> list[int]:
    if isinstance(order, list) and len(order) > MAX_SAMPLER_ORDER:
        raise ValueError(f"sampler_order takes at most {MAX_SAMPLER_ORDER} ids, got {len(order)}")
    if not isinstance(order, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
        raise ValueError(f"sampler_order must be a list of integers, got {_brief(order)}")
    unknown = [i for i in order if i not in KOBOLD_SAMPLER_ORDER]
    if unknown:
        raise ValueError(f"sampler_order has unknown sampler ids {unknown[:8]}; Kobold's ids are 0..6")
    stages: list[int] = []
    for i in order:
        stage = int(KOBOLD_SAMPLER_ORDER[i])
        if stage not in stages:
            stages.append(stage)
    return stages


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rename_field(message: str, source: dict[str, str]) -> str:
    for name in sorted(source, key=len, reverse=True):
        if message.startswith(name) and source[name] != name:
            return f"{source[name]} ({name}){message[len(name):]}"
    return message
