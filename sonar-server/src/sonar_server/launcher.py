"""``sonar serve``: load the engine, start its step loop, serve HTTP until SIGTERM, drain."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

from sonar.cli.engine_args import engine_args_from
from sonar.engine.async_client import AsyncLLM
from sonar_server.app import build_app
from sonar_server.args import settings_from
from sonar_server.state import ServerState

logger = logging.getLogger("sonar_server")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains: /health turns 503, new work gets
    503, running requests get up to ``shutdown_timeout`` seconds to finish (then are
    aborted), and only then does the server stop. A second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self._draining = True
        self.state.draining = True
        logger.info("%s received: draining %d request(s), at most %.0fs", signal.Signals(sig).name, self.state.client.num_in_flight, self.state.settings.shutdown_timeout)
        threading.Thread(target=self._drain, name="sonar-drain", daemon=True).start()

    def _drain(self) -> None:
        client = self.state.client
        deadline = time.monotonic() + self.state.settings.shutdown_timeout
        while client.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if client.num_in_flight:
            logger.warning("shutdown timeout: aborting %d request(s)", client.num_in_flight)
            client.abort_all()
            time.sleep(0.2)  # let the streams send their last event
        self.should_exit = True


def _configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


def serve(args: argparse.Namespace) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    _configure_logging()
    engine_args = engine_args_from(args)
    if args.served_model_name:
        engine_args = dataclasses.replace(engine_args, served_model_name=args.served_model_name[0])
    max_in_flight = engine_args.max_num_seqs + args.max_waiting_requests
    logger.info("loading %s", engine_args.model or "the embedded SmolLM2-135M-Instruct")
    client = AsyncLLM.from_engine_args(engine_args, max_in_flight=max_in_flight)
    try:
        state = ServerState(client, settings_from(args, client.model_config.served_name))
        app = build_app(state)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=5,
        )
        server = DrainingServer(config, state)
        logger.info(
            "serving %s (context %d tokens) on http://%s:%d with APIs: %s%s",
            state.model_name, state.max_model_len, args.host, args.port, ", ".join(state.enabled_apis),
            "; API keys required" if state.settings.api_keys else "",
        )
        server.run()
    finally:
        client.shutdown()
    return 0
