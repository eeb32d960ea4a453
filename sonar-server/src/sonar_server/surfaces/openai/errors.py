"""OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from sonar_server.errors import ApiError
from sonar_server.strict_json import StrictJSONResponse


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def render_error(error: ApiError) -> StrictJSONResponse:
    return StrictJSONResponse(error_body(error), status_code=error.status)
