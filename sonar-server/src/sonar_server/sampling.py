"""Request bodies → ``SamplingParams``: the API's own fields, plus any of the engine's sampling
fields sent as extra body fields (``{"min_p": 0.1, "repetition_penalty": 1.1}``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from sonar.sampling_params import SamplingParams
from sonar_server.errors import ApiError


def engine_sampling_fields() -> set[str]:
    """Every field ``SamplingParams`` takes (it grows as samplers are added)."""
    return {f.name for f in dataclasses.fields(SamplingParams)}


def extra_sampling_fields(body: BaseModel) -> dict[str, Any]:
    """The body's extra fields that name engine sampling fields."""
    fields = engine_sampling_fields()
    return {name: value for name, value in (body.model_extra or {}).items() if name in fields}


def build_sampling_params(body: BaseModel, mapped: dict[str, Any]) -> SamplingParams:
    """``mapped`` (the API's fields renamed to the engine's; None values dropped) over the
    body's extra engine fields. Invalid values raise a 400 naming the field."""
    values = extra_sampling_fields(body)
    values.update({name: value for name, value in mapped.items() if value is not None})
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from exc
