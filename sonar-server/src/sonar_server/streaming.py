"""Server-sent events that notice a client going away, merging of several generations, and
non-streaming work that stops when its client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sonar_server import strict_json
from sonar_server.errors import ClientDisconnected

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Characters JSON may carry raw that line readers splitting like Python's str.splitlines (httpx's
# iter_lines among them) take for line ends, cutting an event's JSON in two: written as escapes
# in events, the same JSON value. (Other such characters are control characters JSON escapes.)
_LINE_BREAKING = ("\u0085", "\u2028", "\u2029")
_LINE_BREAKING_UTF8 = tuple(c.encode() for c in _LINE_BREAKING)


def _one_line_bytes(json_bytes: bytes) -> bytes:
    for char, raw in zip(_LINE_BREAKING, _LINE_BREAKING_UTF8):
        if raw in json_bytes:
            json_bytes = json_bytes.replace(raw, f"\\u{ord(char):04x}".encode())
    return json_bytes


def sse_data(payload: Any, float_free: bool = False) -> bytes:
    """One ``data:`` event of RFC 8259 JSON in UTF-8 (non-finite floats replaced, see
    ``strict_json``), on one line for any line reader. ``float_free``: the caller knows the
    payload holds no float (a content chunk without logprobs); the same event is then written
    faster (``strict_json.dumps_float_free``)."""
    if float_free:
        return b"data: " + _one_line_bytes(strict_json.dumps_float_free(payload)) + b"\n\n"
    return b"data: " + _one_line_bytes(strict_json.dumps_utf8(payload)) + b"\n\n"


def sse_event(event: str, payload: Any) -> bytes:
    """One named event whose ``data:`` is RFC 8259 JSON in UTF-8, on one line for any line reader."""
    return b"event: " + event.encode() + b"\ndata: " + _one_line_bytes(strict_json.dumps_utf8(payload)) + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response whose body generator is cancelled as soon as the
    client disconnects, whatever ASGI version the server speaks; the generator's ``finally``
    then aborts the engine request.

    :param on_close: awaited once the response is over, however it ended (even when the body
        was never started): closes the generations, aborting any that did not finish.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        disconnect_task = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, disconnect_task):
                task.cancel()
            await asyncio.gather(stream_task, disconnect_task, return_exceptions=True)
            if hasattr(self.body_iterator, "aclose"):
                await self.body_iterator.aclose()
            if self.on_close is not None:
                await self.on_close()
        if stream_task.done() and not stream_task.cancelled() and stream_task.exception() is not None:
            raise stream_task.exception()  # type: ignore[misc]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` but cancel it (aborting its engine request) if the client disconnects."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
            raise ClientDisconnected("the client disconnected")
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's position."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            if hasattr(iterators[0], "aclose"):
                await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(position: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((position, item))
        except Exception as exc:
            await queue.put((position, exc))
            return
        await queue.put((position, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
