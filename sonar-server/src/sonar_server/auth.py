"""API keys, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from sonar_server.errors import ApiError


def presented_keys(request: Request) -> list[str]:
    """The keys a request carries: ``Authorization: Bearer <key>`` (OpenAI, Kobold) and
    ``x-api-key: <key>`` (Anthropic)."""
    keys = []
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    api_key = request.headers.get("x-api-key")
    if api_key:
        keys.append(api_key.strip())
    return keys


def check_api_key(request: Request, allowed: list[str]) -> None:
    """Raise 401 unless the request carries one of ``allowed`` (no keys configured: open).

    Every presented key is compared with every allowed key, through fixed-length digests, so
    the time taken says nothing about how close a guess was.
    """
    if not allowed:
        return
    allowed_digests = [hashlib.sha256(key.encode()).digest() for key in allowed]
    ok = False
    for key in presented_keys(request) or [""]:
        digest = hashlib.sha256(key.encode()).digest()
        for expected in allowed_digests:
            ok |= hmac.compare_digest(digest, expected)
    if not ok:
        raise ApiError(
            401,
            "missing or invalid API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
