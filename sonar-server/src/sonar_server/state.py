"""What every route handler reaches through ``request.app.state.sonar``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sonar.engine.async_client import AsyncLLM
from sonar.lora import LoRARequest
from sonar_server.adapters import ServedAdapters
from sonar_server.errors import ApiError
from sonar_server.metrics import ServerMetrics
from sonar_server.peers import ApiServerPeers
from sonar_server.settings import ServerSettings


class ServerState:
    """The engine client, the settings, the metrics and the drain flag of one server.

    :param client: the running engine client.
    :param settings: the server's settings.
    """

    def __init__(self, client: AsyncLLM, settings: ServerSettings, server_index: int = 0, ipc_dir: str | None = None) -> None:
        self.client = client
        self.settings = settings
        self.tokenizer = client.tokenizer
        if settings.chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = settings.chat_template
        self.max_model_len: int = client.model_config.max_model_len
        self.model_path: str = client.model_config.model
        self.started_at = int(time.time())
        self.draining = False
        self.metrics = ServerMetrics(client.get_stats, lambda: client.num_in_flight, settings.model_name)
        self.surface_data: dict[str, Any] = {}  # per-surface state, keyed by surface name
        self.enabled_apis: list[str] = []
        self.adapters = ServedAdapters(client, settings, server_index)
        # the other API servers of this server (none without an IPC directory: one process)
        self.peers = ApiServerPeers(ipc_dir or "", server_index, settings.api_server_count if ipc_dir else 1)

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (its logits' width): what token-id fields are checked against."""
        return self.client.model_config.vocab_size

    async def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, None for the base model (or no name);
        a 404 ApiError for a model this server does not serve."""
        return await self.adapters.resolve(name)

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, "this server was started with --skip-tokenizer-init: send token ids, not text")
        return self.tokenizer

    def check_n(self, n: int) -> None:
        if isinstance(n, int) and n > self.settings.max_n:
            raise ApiError(400, f"n={n} exceeds this server's limit of {self.settings.max_n} (--max-num-seqs)", param="n")

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"
