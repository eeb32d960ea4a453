"""A small HTTP/1.1 client for streamed answers: POST a body, read the answer line by line as it
arrives, over a pool of kept-alive connections (https through an SSL context).

``sonar bench serve`` times servers with it: a general-purpose client's own work per request and
per chunk showed in the benchmark's figures (``benchmarks/bench_client_overhead.py`` measures it).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

READ_SIZE = 64 * 1024
MAX_LINE = 64 * 1024  # longest head line or chunk-size line

# chunked decoder states
_SIZE, _DATA_END, _TRAILERS = range(3)


class ProtocolError(Exception):
    """The answer is not HTTP/1.x as this client reads it."""


class ChunkedDecoder:
    """Chunked transfer coding in, body bytes out, however the input is split."""

    def __init__(self) -> None:
        self.done = False
        self.extra = b""  # bytes after the last chunk
        self._buffer = b""
        self._left = 0  # data bytes of the current chunk still to come
        self._state = _SIZE

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        pieces: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.done:
            if self._left:
                piece = buffer[pos : pos + self._left]
                pieces.append(piece)
                pos += len(piece)
                self._left -= len(piece)
                continue
            newline = buffer.find(b"\n", pos)
            if newline < 0:
                if end - pos > MAX_LINE:
                    raise ProtocolError("a chunk-size line longer than 64 KiB")
                break
            line = buffer[pos:newline].strip()
            pos = newline + 1
            if self._state == _SIZE:
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk-size line {line[:40]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk-size line {line[:40]!r}")
                self._left = size
                self._state = _DATA_END if size else _TRAILERS
            elif self._state == _DATA_END:
                if line:
                    raise ProtocolError(f"chunk data longer than its size: {line[:40]!r}")
                self._state = _SIZE
            elif not line:  # the blank line after the trailers
                self.done = True
        if self.done:
            self.extra = buffer[pos:]
        else:
            self._buffer = buffer[pos:]
        return b"".join(pieces)


class LineSplitter:
    """Bytes in, whole lines out (without their LF, CRLF or CR); a partial line waits for the rest."""

    def __init__(self) -> None:
        self.rest = b""
        self._after_cr = False  # the last bytes ended with CR: an LF first in the next is its pair

    def feed(self, data: bytes) -> list[bytes]:
        if self._after_cr:
            self._after_cr = False
            if data[:1] == b"\n":
                data = data[1:]
        if self.rest:
            data = self.rest + data
            self.rest = b""
        lines = data.splitlines()
        if data.endswith(b"\r"):
            self._after_cr = True
        elif data and not data.endswith(b"\n"):
            self.rest = lines.pop()
        return lines


class StreamResponse:
    """An answer's status and headers; its body whole (``read``), by pieces or by lines."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.complete = False
        self._reader = reader
        self._decoder: ChunkedDecoder | None = None
        self._left: int | None = None  # Content-Length bytes still to come; None: chunked or until close
        self._clean_end = keep_alive  # whether the body ends where the connection can take another request
        if status in (204, 304):
            self.complete = True
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._decoder = ChunkedDecoder()
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {headers['content-length']!r}") from None
            self.complete = self._left == 0
        else:
            self._clean_end = False  # the body ends when the server closes the connection

    @property
    def reusable(self) -> bool:
        """Whether the whole body was read and the connection can take another request."""
        return self.complete and self._clean_end

    async def receive(self) -> bytes:
        """The next body bytes as they arrive; b"" once the body is complete."""
        while not self.complete:
            data = await self._reader.read(READ_SIZE)
            if not data:
                if self._decoder is None and self._left is None:
                    self.complete = True
                    return b""
                raise ConnectionError("the server closed the connection before the end of its answer")
            if self._decoder is not None:
                data = self._decoder.feed(data)
                if self._decoder.done:
                    self.complete = True
                    self._clean_end = self._clean_end and not self._decoder.extra
            elif self._left is not None:
                if len(data) > self._left:
                    data = data[: self._left]
                    self._clean_end = False
                self._left -= len(data)
                self.complete = self._left == 0
            if data:
                return data
        return b""

    async def read(self) -> bytes:
        pieces = []
        while not self.complete:
            pieces.append(await self.receive())
        return b"".join(pieces)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines as bytes, each as soon as its line break arrives."""
        splitter = LineSplitter()
        while not self.complete:
            for line in splitter.feed(await self.receive()):
                yield line
        if splitter.rest:
            yield splitter.rest


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.timed_out = False

    def is_open(self) -> bool:
        return not (self.reader.at_eof() or self.reader.exception() or self.writer.is_closing())

    def expire(self) -> None:
        self.timed_out = True
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


class StreamClient:
    """POSTs to one server; a connection whose answer was read to its end is kept for the next.
    https URLs are verified with ``ssl_context`` (default: the system's certificate authorities)."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        *,
        connect_timeout: float = 30.0,
        timeout: float = 6 * 3600.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r}: expected an http:// or https:// URL")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self._ssl = (ssl_context or ssl.create_default_context()) if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        fields = {"Host": url.netloc.rpartition("@")[2], "User-Agent": "sonar-bench", "Accept": "*/*", "Content-Type": "application/json", **(headers or {})}
        self._head_fields = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
        self._idle: list[_Connection] = []

    @asynccontextmanager
    async def post(self, path: str, body: bytes) -> AsyncIterator[StreamResponse]:
        """POST ``body`` to the base URL's path + ``path``; the answer once its head is in.

        Raises ``TimeoutError`` past ``connect_timeout`` to connect or ``timeout`` to answer in full,
        ``ConnectionError`` when the server closes the connection early, ``ProtocolError``.
        """
        head = f"POST {self._prefix}{path} HTTP/1.1\r\n{self._head_fields}Content-Length: {len(body)}\r\n\r\n"
        request = head.encode("latin-1") + body
        loop = asyncio.get_running_loop()
        while True:
            connection, reused = await self._connection()
            timer = loop.call_later(self.timeout, connection.expire)
            try:
                connection.writer.write(request)
                await connection.writer.drain()
                status, headers, keep_alive = await _read_head(connection.reader)
                response = StreamResponse(status, headers, connection.reader, keep_alive)
            except BaseException as exc:
                timer.cancel()
                connection.close()
                if connection.timed_out and isinstance(exc, Exception):
                    raise TimeoutError(f"no answer within {self.timeout:g} s") from exc
                if reused and isinstance(exc, ConnectionError):
                    continue  # the server had closed the kept connection: a new one
                raise
            break
        try:
            yield response
        except (ConnectionError, ProtocolError) as exc:
            if connection.timed_out:
                raise TimeoutError(f"no complete answer within {self.timeout:g} s") from exc
            raise
        finally:
            timer.cancel()
            if response.reusable and not connection.timed_out and connection.is_open():
                self._idle.append(connection)
            else:
                connection.close()

    async def _connection(self) -> tuple[_Connection, bool]:
        while self._idle:
            connection = self._idle.pop()
            if connection.is_open():
                return connection, True
            connection.close()
        opening = asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=MAX_LINE)
        try:
            reader, writer = await asyncio.wait_for(opening, self.connect_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"could not connect to {self.host}:{self.port} within {self.connect_timeout:g} s") from None
        return _Connection(reader, writer), False

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bool]:
    """The status, the headers (lower-case names) and whether the connection stays open."""
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("the server closed the connection without answering")
        version, _, rest = line.partition(b" ")
        try:
            status = int(rest[:3])
        except ValueError:
            status = 0
        if not version.startswith(b"HTTP/1.") or status < 100:
            raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if not line:
                raise ConnectionError("the server closed the connection in the middle of its answer's head")
            if not line.strip():
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if status >= 200:
            break  # 1xx: an interim answer, the final one follows
    connection = headers.get("connection", "").lower()
    keep_alive = "keep-alive" in connection if version == b"HTTP/1.0" else "close" not in connection
    return status, headers, keep_alive
