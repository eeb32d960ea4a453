"""One error type for every API surface; each surface renders it in its own format."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sonar.engine.async_client import EngineClosedError, EngineDeadError, QueueFull
from sonar.lora import LoRAInUseError

# error kinds, named as OpenAI and Anthropic name them
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
TOO_LARGE = "request_too_large"
OVERLOADED = "overloaded_error"
INTERNAL = "api_error"

_KIND_BY_STATUS = {401: AUTHENTICATION, 404: NOT_FOUND, 413: TOO_LARGE, 503: OVERLOADED}


class ApiError(Exception):
    """An HTTP error with a message for the client.

    :param status: HTTP status code.
    :param message: what was wrong and what to do.
    :param kind: one of the kinds above; defaults from the status.
    :param param: the request field at fault, when there is one.
    :param headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _KIND_BY_STATUS.get(status, INVALID_REQUEST if status < 500 else INTERNAL)
        self.param = param
        self.headers = headers or {}


CLIENT_CLOSED_REQUEST = 499  # the status proxies log for a request whose client went away first


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def to_api_error(exc: BaseException, retry_after_s: int = 1) -> ApiError:
    """Map any exception raised while serving a request onto an ApiError."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return ApiError(400, validation_message(exc.errors()), param=_first_param(exc.errors()))
    if isinstance(exc, HTTPException):
        if exc.status_code == 400 and isinstance(exc.__cause__, (RecursionError, ValueError)):  # FastAPI's "error parsing the body"
            return ApiError(400, f"the body is not valid JSON ({_unparsed_reason(exc.__cause__)})")
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    if isinstance(exc, QueueFull):
        return ApiError(503, f"the server is busy: {exc}", headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc))
    if isinstance(exc, EngineClosedError):
        return ApiError(503, "the server is shutting down", headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, LoRAInUseError):  # its adapter is being unloaded
        return ApiError(409, str(exc), param="model")
    if isinstance(exc, ClientDisconnected):  # nobody reads the answer: not a server error
        return ApiError(CLIENT_CLOSED_REQUEST, str(exc))
    if isinstance(exc, ClientDisconnect):  # gone while sending its body: nobody reads the answer either
        return ApiError(CLIENT_CLOSED_REQUEST, "the client disconnected while sending its request")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def _unparsed_reason(cause: BaseException) -> str:
    if isinstance(cause, RecursionError):
        return "it nests deeper than this server reads"
    if "digits" in str(cause):  # Python's bound on the digits of an integer it reads
        return "a number in it has more digits than this server reads"
    return str(cause)


# pydantic's word for a body that is not a JSON object at all (a list, a number, nothing)
_NOT_AN_OBJECT = {"missing", "model_type", "model_attributes_type", "dict_type"}


def validation_message(errors: Any) -> str:
    """Up to five of pydantic's errors as one line; errors a validator raised (a list past its
    bound) first, in its own words, ahead of the type mismatches of a union's other members."""
    parts = []
    for error in sorted(errors, key=lambda error: error.get("type") != "value_error")[:5]:
        location = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
        message = error.get("msg", "invalid")
        kind = error.get("type")
        if kind == "json_invalid":
            message = f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')})"
            location = ""
        elif kind == "value_error" and "error" in error.get("ctx", {}):
            message = str(error["ctx"]["error"])  # without pydantic's "Value error, "
        elif not location and kind in _NOT_AN_OBJECT:
            message = "the request body must be a JSON object"
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts) or "invalid request"


def _first_param(errors: Any) -> str | None:
    for error in errors:
        location = [str(x) for x in error.get("loc", ()) if x != "body"]
        if location and error.get("type") != "json_invalid":
            return ".".join(location)
    return None
