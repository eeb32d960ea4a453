"""The generated arguments reference is current; API surfaces are plugins, chosen by --api."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from sonar.engine.async_client import AsyncLLM
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar_server import docs_gen
from sonar_server.app import api_surfaces, build_app
from sonar_server.settings import ServerSettings
from sonar_server.state import ServerState


def test_server_arguments_reference_is_up_to_date():
    assert docs_gen.DEFAULT_OUTPUT.read_text() == docs_gen.render(), "run: python -m sonar_server.docs_gen"
    for flag in ("--api-key", "--max-waiting-requests", "--shutdown-timeout", "--max-request-body-bytes", "--kv-cache-memory-bytes"):
        assert f"`{flag} " in docs_gen.render()


class _IdleEngine:
    tokenizer = None
    model_config = SimpleNamespace(max_model_len=64, model="/models/idle", served_name="idle")

    def has_unfinished_requests(self) -> bool:
        return False

    def get_stats(self) -> None:
        return None


class _HelloSurface:
    """A third-party API surface, registered the way an installed package's would be."""

    @hookimpl
    def sonar_register_api_surfaces(self, register):
        def install(app, state):
            @app.get("/hello")
            async def hello() -> dict:
                return {"model": state.model_name}

        register("hello", install)


@pytest.fixture
def hello_plugin():
    manager = get_plugin_manager()
    plugin = _HelloSurface()
    manager.register(plugin, name="test-hello-surface")
    try:
        yield
    finally:
        manager.unregister(plugin)


def _app(apis: list[str] | None):
    client = AsyncLLM(_IdleEngine())
    return build_app(ServerState(client, ServerSettings(served_model_names=["idle"], apis=apis))), client


def test_built_in_surfaces_come_from_the_entry_point():
    assert {"openai", "anthropic", "kobold", "ops"} <= set(api_surfaces())


def test_a_third_party_surface_is_served_and_api_selects_surfaces(hello_plugin):
    app, client = _app(["hello", "ops"])
    try:
        http = TestClient(app)
        assert http.get("/hello").json() == {"model": "idle"}
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 404  # openai not selected
        paths = set(http.get("/openapi.json").json()["paths"])
        assert "/hello" in paths and "/v1/completions" not in paths
    finally:
        client.shutdown()


def test_unknown_surface_is_an_error():
    with pytest.raises(ValueError, match="unknown API surface"):
        _app(["nonexistent"])
