"""OpenAI's error format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from sonar_server.errors import ApiError


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def render_error(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)
