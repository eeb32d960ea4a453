"""Structured-output fields of request bodies → the engine's ``GuidedDecodingParams``:
OpenAI ``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` /
``guided_choice`` / ``structured_outputs`` extra fields, Kobold's ``grammar``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sonar.structured_output import GuidedDecodingParams

from sonar_server.errors import ApiError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


def _params(values: dict[str, Any], param: str) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams.from_value(values)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from exc


def response_format_guide(response_format: dict[str, Any] | None) -> GuidedDecodingParams | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params({"json_object": True}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows leaving the schema out
        return _params({"json": schema}, "response_format.json_schema.schema")
    raise ApiError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema", param="response_format")


def body_guide(body: BaseModel, response_format: dict[str, Any] | None = None) -> GuidedDecodingParams | None:
    """The one constraint a body asks for, from ``response_format`` or vLLM's extra fields;
    more than one is a 400."""
    extra = body.model_extra or {}
    found: list[tuple[str, GuidedDecodingParams]] = []
    from_format = response_format_guide(response_format)
    if from_format is not None:
        found.append(("response_format", from_format))
    for field, kind in GUIDED_FIELDS.items():
        if extra.get(field) is not None:
            found.append((field, _params({kind: extra[field]}, field)))
    for field in ("structured_outputs", "guided_decoding"):
        if extra.get(field) is not None:
            found.append((field, _params(extra[field], field)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"send one structured-output constraint, got {names}", param=found[1][0])
    return found[0][1] if found else None
