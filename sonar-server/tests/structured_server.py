"""One ``sonar serve`` with automatic tool choice and a reasoning parser, shared by the
structured-output, tool and reasoning tests of this folder (started on first use)."""

from __future__ import annotations

import atexit

from conftest import KV_CACHE_BYTES, ServerProcess

FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
_server: ServerProcess | None = None


def tools_server(tiny_model: str) -> ServerProcess:
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = ServerProcess(
            [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512", *FLAGS]
        )
        atexit.register(_server.stop)
    return _server
