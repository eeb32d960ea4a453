"""One API server: the HTTP app and its engine-core client. ``sonar serve`` runs one in its own
process, or ``--api-server-count`` of them as ``python -m sonar_server.api_server`` children
that share its listening socket; each reads an ``ApiServerLaunch`` (JSON) from stdin."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from sonar.config import EngineConfig
from sonar.engine.wire import ClientAddresses
from sonar_server.settings import ServerSettings

logger = logging.getLogger("sonar_server")

STARTUP_FAILED = 3  # the exit code of an API server (and of ``sonar serve``) that could not start serving
API_SERVER_DIED = 4  # the exit code of ``sonar serve`` when an API server exits while serving, unasked
SERVING = b"serving"  # what a child writes to its ready_fd once it serves


class ApiServerLaunch(msgspec.Struct):
    config: EngineConfig
    settings: ServerSettings
    client_index: int
    addresses: ClientAddresses
    max_in_flight: int
    engine_step_timeout: float
    uvicorn_log_level: str = "warning"
    access_log: bool = False
    log_level: str = "INFO"
    listen_fd: int = -1  # the inherited listening socket (child processes)
    ipc_dir: str | None = None  # the server's private socket directory (the API servers' peer channel)
    ready_fd: int = -1  # a pipe to write SERVING to once serving (child processes): the supervisor's sign of a start


def run_api_server(launch: ApiServerLaunch, listener: socket.socket, tokenizer: Any = None, check_started: Callable[[], None] | None = None) -> int:
    """Connect to the engine cores, then serve HTTP on ``listener`` until stopped (drained);
    ``STARTUP_FAILED`` where the HTTP server never started."""
    import uvicorn

    from sonar.engine.async_mp import AsyncMPLLM
    from sonar.engine.process_util import freeze_startup_heap
    from sonar.engine.resolve import load_tokenizer
    from sonar_server.app import build_app
    from sonar_server.draining import DrainingServer
    from sonar_server.http_protocol import timed_headers_protocol
    from sonar_server.state import ServerState

    if launch.settings.tool_parser_plugin:  # this process's registry needs its parsers too
        from sonar_server.parsers.plugin_file import load_tool_parser_plugin

        load_tool_parser_plugin(launch.settings.tool_parser_plugin)
    if tokenizer is None:
        tokenizer = load_tokenizer(launch.config)
    client = AsyncMPLLM(
        launch.config, tokenizer, launch.addresses, launch.client_index, launch.max_in_flight, launch.engine_step_timeout, check_started
    )
    try:
        state = ServerState(client, launch.settings, launch.client_index, launch.ipc_dir)
        app = build_app(state)
        tls = launch.settings.tls
        config = uvicorn.Config(
            app,
            http=timed_headers_protocol(launch.settings.request_read_timeout_s),
            log_level=launch.uvicorn_log_level,
            access_log=launch.access_log,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=5,
            root_path=launch.settings.root_path,
            **({} if tls is None else {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile, "ssl_ca_certs": tls.ca_certs, "ssl_cert_reqs": tls.cert_reqs}),
        )
        def report_serving() -> None:
            scheme = "http" if tls is None else "https"
            if listener.family == socket.AF_UNIX:
                where = f"{scheme} over the Unix socket {listener.getsockname()}"
            else:
                host, port = listener.getsockname()[:2]
                where = f"{scheme}://{host}:{port}"
            adapters = state.settings.lora_modules
            logger.info(
                "serving %s (context %d tokens) on %s with APIs: %s%s%s",
                state.model_name, state.max_model_len, where, ", ".join(state.enabled_apis),
                f"; LoRA adapters: {', '.join(m.name for m in adapters)}" if adapters else "",
                "; API keys required" if state.settings.api_keys else "",
            )

        def serving() -> None:
            if launch.client_index == 0:
                report_serving()
            if launch.ready_fd >= 0:
                os.write(launch.ready_fd, SERVING)
                os.close(launch.ready_fd)

        server = DrainingServer(config, state, serving)
        freeze_startup_heap()
        server.run(sockets=[listener])
    finally:
        client.shutdown()
    if not server.started:  # uvicorn logged why (a certificate it cannot load, ...)
        logger.error("api-server-%d: the HTTP server did not start", launch.client_index)
        return STARTUP_FAILED
    return 0


def main() -> int:
    from sonar.engine.process_util import exit_with_parent, set_process_title

    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=ApiServerLaunch)
    exit_with_parent()
    set_process_title(f"api-server-{launch.client_index}")
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s api-server-{launch.client_index} %(name)s: %(message)s")
    logger.setLevel(launch.log_level)
    listener = socket.socket(fileno=launch.listen_fd)
    try:
        return run_api_server(launch, listener)
    except ValueError as exc:  # a bad --lora-modules adapter or --tool-parser-plugin file: a message, not a traceback
        logger.error("%s", exc)
        return STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
