"""Request bodies → ``SamplingParams``: the API's own fields, plus any of the engine's sampling
fields sent as extra body fields (``{"min_p": 0.1, "repetition_penalty": 1.1}``), over the
model's recommended sampling (``--generation-config``) for the fields the request leaves out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from sonar.sampling_params import SamplingParams, check_token_id_counts
from sonar_server.errors import ApiError

# the body fields that carry a request's own output budget
_MAX_TOKENS_FIELDS = {"max_tokens", "max_completion_tokens", "max_length"}


# fields the server sets itself: its streaming reads cumulative outputs
SERVER_OWNED_FIELDS = frozenset({"output_kind"})


def engine_sampling_fields() -> set[str]:
    """Every field ``SamplingParams`` takes (it grows as samplers are added) that a request
    may set."""
    return {f.name for f in dataclasses.fields(SamplingParams)} - SERVER_OWNED_FIELDS


def extra_sampling_fields(body: BaseModel) -> dict[str, Any]:
    """The body's extra fields that name engine sampling fields."""
    fields = engine_sampling_fields()
    return {name: value for name, value in (body.model_extra or {}).items() if name in fields}


def build_sampling_params(
    body: BaseModel, mapped: dict[str, Any], defaults: Mapping[str, Any] | None = None, vocab_size: int | None = None
) -> SamplingParams:
    """``mapped`` (the API's fields renamed to the engine's; None values dropped) over the
    body's extra engine fields, over ``defaults`` (the model's recommended sampling). A default
    ``max_tokens`` caps the surface's own fallback budget when the body sets none. Invalid
    values raise a 400 naming the field; with ``vocab_size``, so do token-id lists and
    ``logit_bias`` longer than the vocabulary, before anything walks them."""
    values = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
    values.update(extra_sampling_fields(body))
    values.update({name: value for name, value in mapped.items() if value is not None})
    default_max = (defaults or {}).get("max_tokens")
    if default_max is not None and not (_MAX_TOKENS_FIELDS & body.model_fields_set) and "max_tokens" not in extra_sampling_fields(body):
        fallback = values.get("max_tokens")
        values["max_tokens"] = default_max if fallback is None else min(default_max, fallback)
    try:
        if vocab_size is not None:
            check_token_id_counts(values, vocab_size)
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from exc
