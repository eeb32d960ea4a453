"""The route class every API surface uses: API key, drain and body-size checks before the
handler, every error rendered in the surface's own format, and every JSON body written as
RFC 8259 JSON (``StrictJSONResponse``)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from sonar_server.auth import check_api_key
from sonar_server.errors import ApiError, to_api_error
from sonar_server.list_limits import server_bounds
from sonar_server.strict_json import StrictJSONResponse

logger = logging.getLogger(__name__)

ErrorRenderer = Callable[[ApiError], Response]

_BODY_METHODS = {"POST", "PUT", "PATCH"}
_DRAIN_FACTOR = 8  # bodies up to 8x the limit are read and dropped, so the client sees the 413
_LENIENT_CONTENT_TYPES = ("", "application/x-www-form-urlencoded", "text/plain")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate
# one with no partner: a high surrogate's escape not followed by a low one's, or a low one's
# not preceded by a high one's (read where every backslash starts an escape, see below)
_LONE_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F][0-9a-fA-F]{2})"
)


def surface_router(render_error: ErrorRenderer, guarded: bool = True, tags: list[str] | None = None) -> APIRouter:
    """A router whose routes check the API key (when ``guarded``), refuse work while draining,
    cap the body size, render errors with ``render_error`` and write the values handlers
    return as strict JSON."""
    return APIRouter(route_class=_route_class(render_error, guarded), tags=list(tags or []), default_response_class=StrictJSONResponse)


def _route_class(render_error: ErrorRenderer, guarded: bool) -> type[APIRoute]:
    class SurfaceRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                state = request.app.state.sonar
                try:
                    if guarded:
                        check_api_key(request, state.settings.api_keys)
                        if state.draining:
                            raise ApiError(503, "the server is shutting down", headers={"Retry-After": str(state.settings.retry_after_s)})
                    if request.method in _BODY_METHODS:
                        await read_body(request, state.settings.max_request_body_bytes, state.settings.request_read_timeout_s)
                    with server_bounds(state.max_model_len, state.settings.max_n):
                        return await handler(request)
                except Exception as exc:
                    error = to_api_error(exc, state.settings.retry_after_s)
                    if error.status >= 500 and error.status != 503:
                        logger.exception("%s %s failed", request.method, request.url.path)
                    response = render_error(error)
                    response.headers.update(error.headers)
                    return response

            return handle

    return SurfaceRoute


async def read_body(request: Request, limit: int, timeout_s: float = 60.0) -> bytes:
    """Read the body under a size cap and a time limit (all of it within ``timeout_s`` of the
    call: a client that holds a connection open by trickling its body gets 408, and the
    connection is closed), check it is UTF-8, and treat it as JSON when the client did not say
    what it is (``curl -d``)."""
    too_large = f"more than this server's limit of {limit} bytes (--max-request-body-bytes)"
    declared = request.headers.get("content-length", "")
    chunks_in_time = _arriving_within(request, timeout_s)
    if declared.isdigit() and int(declared) > limit:
        if int(declared) <= _DRAIN_FACTOR * limit:
            async for _ in chunks_in_time:
                pass
        raise ApiError(413, f"the request body is {declared} bytes, {too_large}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in chunks_in_time:
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > _DRAIN_FACTOR * limit:
            break
    if size > limit:
        raise ApiError(413, f"the request body is {too_large}")
    body = b"".join(chunks)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})") from exc
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(body)
    request._body = body  # FastAPI's body parsing reads it from here
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if body and content_type in _LENIENT_CONTENT_TYPES:
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
        request.scope["headers"] = headers + [(b"content-type", b"application/json")]
        if hasattr(request, "_headers"):
            del request._headers
    return body


async def _arriving_within(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, until ``timeout_s`` from now: past it, 408."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {timeout_s:g} s (--request-read-timeout)", headers={"Connection": "close"}
            ) from None
        yield chunk


def _refuse_lone_surrogates(body: bytes) -> None:
    """A 400 for a JSON body whose strings hold a lone UTF-16 surrogate (``"\\ud800"`` with no
    partner): valid JSON syntax, but no Unicode text, so no tokenizer or encoder can take it.
    Escaped pairs (an emoji written as two escapes) read as the one character they are. A scan
    of the bytes, not a parse: a body of any shape costs the event loop a few milliseconds."""
    escapes = body.replace(b"\\\\", b"__")  # escaped backslashes, paired left to right as JSON reads them, out of the way
    found = _LONE_SURROGATE_ESCAPE.search(escapes)
    if found is not None:
        code = found.group(0)[2:].decode("ascii").lower()
        raise ApiError(400, f"the request body holds a lone UTF-16 surrogate (\\u{code}): not valid Unicode text")
