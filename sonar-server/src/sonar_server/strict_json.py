"""RFC 8259 JSON in and out: every response body and SSE event is written without ``NaN`` or
``Infinity``, and JSON found in a model's text is read without accepting them.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default, and reads them
back; JavaScript's ``JSON.parse``, Go's ``encoding/json`` and most other clients reject them.
Non-finite floats in an output are replaced before writing:

- ``-inf`` → ``-9999.0``: vLLM's convention for the logprob of a token that cannot be drawn
  (masked by a grammar, ``allowed_token_ids``, a ``-inf`` logit); ``exp(-9999.0)`` is ``0.0``.
- ``NaN`` and ``+inf`` → ``null``: no finite number means what they mean (a logprob is never
  above 0), so the field says "no value".
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response

NEG_INF_STAND_IN = -9999.0


def finite_float(value: float) -> float | None:
    """``value`` if finite, else its stand-in (``-inf`` → ``-9999.0``; ``NaN``, ``+inf`` → None)."""
    if math.isfinite(value):
        return value
    return NEG_INF_STAND_IN if value < 0 else None


def finite_logprob(value: float) -> float | None:
    """A logprob as vLLM writes it: clamped to at least ``-9999.0`` (so ``-inf`` is ``-9999.0``);
    NaN and ``+inf`` (never a real logprob) are None."""
    if math.isnan(value) or value == math.inf:
        return None
    return max(value, NEG_INF_STAND_IN)


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float in its dicts, lists and tuples replaced by its
    stand-in (tuples become lists, as JSON writes them). Other values are returned as they are."""
    if isinstance(obj, float):
        return finite_float(obj)
    if isinstance(obj, dict):
        return {key: finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(value) for value in obj]
    return obj


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # one, not one per event


def dumps(obj: Any) -> str:
    """``obj`` as RFC 8259 JSON text (non-finite floats replaced, see ``finite``), UTF-8 kept
    as is, compact. Raises ValueError for what JSON cannot hold at all (a circular reference)."""
    try:
        return _ENCODER.encode(obj)
    except ValueError:  # a non-finite float somewhere: pay for the walk only then
        return _ENCODER.encode(finite(obj))


_ASCII_ENCODER = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def dumps_utf8(obj: Any) -> bytes:
    """``dumps(obj)`` as UTF-8 bytes. A string holding a lone surrogate (a model's JSON text
    with an unpaired ``\\ud800`` escape, decoded by ``loads``) has no UTF-8 form: the whole
    value is then written with every non-ASCII character escaped, the same JSON value, the
    surrogate kept as its escape."""
    text = dumps(obj)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _ASCII_ENCODER.encode(finite(obj)).encode("ascii")


_FLOAT_FREE_ENCODER = msgspec.json.Encoder()


def dumps_float_free(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON, for values that hold no float (strings, integers, bools,
    None, and lists and dicts of them: a stream's content chunks). msgspec writes these about
    ten times faster than ``dumps``, byte for byte the same. Should a float get in anyway it is
    written in its shortest form, a non-finite one as ``null``: still RFC 8259, but ``-inf``
    does not get its ``-9999.0`` stand-in, so values that can hold logprobs go through
    ``dumps``. A lone surrogate in a string is written as ``dumps_utf8`` writes it."""
    try:
        return _FLOAT_FREE_ENCODER.encode(obj)
    except UnicodeEncodeError:  # a string with no UTF-8 form
        return dumps_utf8(obj)


class StrictJSONResponse(JSONResponse):
    """A JSONResponse whose body is RFC 8259 JSON: non-finite floats are replaced (see
    ``finite``) instead of failing the response with a 500."""

    def render(self, content: Any) -> bytes:
        return dumps_utf8(content)


# logprob entries past which a response is built and written in a worker thread: about 10 ms
# of work on the event loop (a 25 MB response of n=32 and top_logprobs=20 took 1.2 s there)
LARGE_RESPONSE_ENTRIES = 20_000


async def built_response(build: Callable[[], Any], num_entries: int) -> Response:
    """A StrictJSONResponse of ``build()``; where the body holds more than
    ``LARGE_RESPONSE_ENTRIES`` logprob entries, built and encoded in a worker thread, so the
    event loop keeps serving every other stream meanwhile (with the interpreter lock shared,
    in turns, instead of stalling for the whole of it)."""
    if num_entries <= LARGE_RESPONSE_ENTRIES:
        return StrictJSONResponse(build())
    body = await asyncio.to_thread(lambda: dumps_utf8(build()))
    return Response(body, media_type="application/json")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259)")


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON syntax, but no double holds it
        raise ValueError(f"{text} is out of the range of a JSON number this server can write")
    return value


DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_number)


def loads(text: str) -> Any:
    """``text`` as JSON, refusing ``NaN``, ``Infinity``, ``-Infinity``, numbers that overflow a
    double and nesting past the parser's depth (ValueError), so what it returns can be written
    back as strict JSON."""
    try:
        return DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    """The strict JSON value beginning at ``text[start]`` (after whitespace) and the index
    after it; ValueError if there is none (or it nests past the parser's depth)."""
    try:
        return DECODER.raw_decode(text, _skip_space(text, start))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _skip_space(text: str, start: int) -> int:
    while start < len(text) and text[start].isspace():
        start += 1
    return start
