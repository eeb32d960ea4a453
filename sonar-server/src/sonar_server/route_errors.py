"""404 and 405 for requests no route takes, in the error format of the API the path belongs
to: ``/api/...`` is KoboldAI's, ``/v1/messages...`` (or any request with an
``anthropic-version`` header) Anthropic's, everything else OpenAI's. The path is named, so an
SDK shows more than "Error code: 404"."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sonar_server.errors import ApiError


def _renderer(request: Request) -> Callable[[ApiError], Response]:
    path = request.url.path
    if path == "/api" or path.startswith("/api/"):
        from sonar_server.surfaces.kobold import render_error
    elif path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        from sonar_server.surfaces.anthropic import render_error
    else:
        from sonar_server.surfaces.openai.errors import render_error
    return render_error


def _error(request: Request, exc: HTTPException) -> ApiError:
    path = request.url.path
    if exc.status_code == 404:
        return ApiError(404, f"{request.method} {path}: no such route on this server; GET /docs lists the routes it serves")
    if exc.status_code == 405:
        allowed = next((value for key, value in (exc.headers or {}).items() if key.lower() == "allow"), "")
        message = f"{path} does not take {request.method}" + (f"; it takes {allowed}" if allowed else "")
        return ApiError(405, message, headers={"Allow": allowed} if allowed else None)
    return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))


async def _handle(request: Request, exc: HTTPException) -> Response:
    error = _error(request, exc)
    response = _renderer(request)(error)
    response.headers.update(error.headers)
    return response


def install_route_errors(app: FastAPI) -> None:
    """Answer unrouted requests (404) and wrong methods (405) in the API's own error format."""
    app.add_exception_handler(HTTPException, _handle)
