"""Bounds on the lists of request bodies, checked as pydantic validates a body, before it
builds a model per entry: no body within ``--max-request-body-bytes`` makes validation the
event loop's main cost, which every other stream of the API server would wait on.

- ``Items[T]``: a list whose validation stops at its first bad entry. By default pydantic
  reports one error per bad entry: a prompt of a million floats was 10 s of error objects.
- ``context_bounded(noun)``: a list of at most ``max_model_len`` entries (a chat's messages,
  a message's content parts, token ids to decode): no more fit in the model's context. 250,000
  messages were 0.9 s of validation.
- ``batch_bounded(noun)``: a list of at most ``--max-num-seqs`` lists or strings (a
  completion's prompts; a list of integers is one prompt's token ids): no more run at once.

Each validator goes on a whole field, a union included (it reads the raw value first), so
error locations keep the union members' own names.

The bounds are the serving route's (``server_bounds``); outside a route nothing is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field

T = TypeVar("T")

Items = Annotated[list[T], Field(fail_fast=True)]

_bounds: ContextVar[tuple[int, int] | None] = ContextVar("sonar_list_bounds", default=None)


@contextmanager
def server_bounds(max_model_len: int, max_num_seqs: int) -> Iterator[None]:
    """Bodies validated inside are bounded by this server's context and sequence limits."""
    token = _bounds.set((max_model_len, max_num_seqs))
    try:
        yield
    finally:
        _bounds.reset(token)


def context_bounded(noun: str) -> BeforeValidator:
    """A validator refusing a list longer than the model's context before its entries are
    validated; ``noun`` names the entries in the message (``"messages"``)."""

    def check(value: Any) -> Any:
        bounds = _bounds.get()
        if bounds is not None and isinstance(value, list) and len(value) > bounds[0]:
            raise ValueError(f"{len(value)} {noun} cannot fit in the model's context of {bounds[0]} tokens")
        return value

    return BeforeValidator(check)


def batch_bounded(noun: str) -> BeforeValidator:
    """A validator refusing a list of lists or strings longer than the sequences this server
    runs at once (a list of anything else is left to the field's type)."""

    def check(value: Any) -> Any:
        bounds = _bounds.get()
        if bounds is not None and isinstance(value, list) and len(value) > bounds[1] and isinstance(value[0], (list, str)):
            raise ValueError(f"{len(value)} {noun} are more than this server runs at once ({bounds[1]}, --max-num-seqs)")
        return value

    return BeforeValidator(check)
