"""uvicorn's HTTP/1.1 protocol (httptools) with a limit on how long a request's headers take.

uvicorn closes a connection that idles after a response (``timeout_keep_alive``), but not one
that never finishes its headers: a fresh connection that sends nothing, or a request whose
header lines come one byte at a time, stays open for as long as the client likes, each holding
a file descriptor. Here the headers of every request must arrive within the read timeout, counted
from the connection (its first request) or from the request's first byte (a later one); past
it the server answers 408 and closes the connection. The body has the same limit, counted from
the end of the headers (``sonar_server.routing.read_body``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_MESSAGE = b"the request headers did not arrive in time (--request-read-timeout)"
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_MESSAGE)).encode() + b"\r\nconnection: close\r\n\r\n" + _MESSAGE
)


def timed_headers_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class, its requests' headers limited to ``timeout_s``
    seconds (give it as ``uvicorn.Config(http=...)``)."""

    class TimedHeadersProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(_TIMED_OUT)
                self.transport.close()

    return TimedHeadersProtocol
