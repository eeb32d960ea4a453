"""uvicorn with a graceful drain on the first SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from sonar_server.state import ServerState
from sonar_server.tls_refresh import CertificateRefresher

logger = logging.getLogger("sonar_server")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains: /health turns 503, new work gets
    503, running requests get up to ``shutdown_timeout`` seconds to finish (then are
    aborted), and only then does the server stop. A second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, on_serving: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.on_serving = on_serving
        self._draining = False
        self.certificate_refresher: CertificateRefresher | None = None

    async def startup(self, sockets: list | None = None) -> None:
        """Load the ``--lora-modules`` adapters, then start answering (and call
        ``on_serving``): until then connections wait in the listening socket's backlog,
        ``/health`` included."""
        await self.state.adapters.load_startup()
        await self.state.peers.start()
        await super().startup(sockets=sockets)
        tls = self.state.settings.tls
        if tls is not None and tls.refresh and self.config.ssl is not None:  # --enable-ssl-refresh
            self.certificate_refresher = CertificateRefresher(self.config.ssl, tls)
            self.certificate_refresher.start()
        if self.on_serving is not None:
            self.on_serving()

    async def shutdown(self, sockets: list | None = None) -> None:
        if self.certificate_refresher is not None:
            await self.certificate_refresher.stop()
        await super().shutdown(sockets=sockets)
        await self.state.peers.close()

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
