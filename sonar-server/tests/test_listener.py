"""The listening socket every API server accepts on."""

from __future__ import annotations

import asyncio
import socket

from sonar_server.launcher import bind_listener


def test_accepted_connections_send_without_waiting_for_acks() -> None:
    """Connections accepted on the listener have TCP_NODELAY: a response written in two parts
    (headers, then body) goes out at once instead of waiting for the client's delayed ACK,
    which cost ~40 ms per request on a kept-alive connection."""
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.read()
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
    assert listener.proto == socket.IPPROTO_TCP


def test_a_port_in_use_is_refused_with_a_message() -> None:
    first = bind_listener("127.0.0.1", 0)
    try:
        bind_listener("127.0.0.1", first.getsockname()[1])
    except ValueError as exc:
        assert "cannot listen on 127.0.0.1" in str(exc)
    else:
        raise AssertionError("a second listener bound a port in use")
    finally:
        first.close()
