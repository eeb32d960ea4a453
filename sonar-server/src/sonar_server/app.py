"""The FastAPI app factory."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from sonar_server import __version__
from sonar_server.docs_ui import install_docs
from sonar_server.plugin import collect_server_hook
from sonar_server.route_errors import install_route_errors
from sonar_server.state import ServerState

logger = logging.getLogger(__name__)

DESCRIPTION = """OpenAI-, Anthropic- and KoboldAI-compatible APIs over one Sonar engine.

With `--api-key`, every route answers 401 without a key (`Authorization: Bearer <key>` or
`x-api-key: <key>`), except `/health`, `/ping`, `/version`, `/metrics`, `/openapi.json`,
`/docs`, `/api/v1/info/version` and `/api/extra/version`."""


def api_surfaces() -> dict[str, Callable[[Any, Any], None]]:
    """Every API surface registered through ``sonar_register_api_surfaces``, by name."""
    surfaces: dict[str, Callable[[Any, Any], None]] = {}
    for name, install in collect_server_hook("sonar_register_api_surfaces"):
        if name in surfaces:
            logger.warning("API surface %r is registered twice; keeping the first", name)
            continue
        surfaces[name] = install
    return surfaces


def import_middleware(path: str) -> Any:
    """``--middleware``'s ``module.name`` (or ``module:name``): an ASGI middleware class, or a
    function ``async (request, call_next) -> response``. Raises ValueError naming what failed."""
    module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"--middleware {path!r} is not an import path (module.Name)")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {path!r} cannot be imported: {exc}") from None
    if not callable(target):
        raise ValueError(f"--middleware {path!r} is neither a middleware class nor a function")
    return target


def add_middleware(app: FastAPI, path: str) -> None:
    """Add ``--middleware``'s class (``app.add_middleware``) or function (HTTP middleware), as vLLM does."""
    target = import_middleware(path)
    if inspect.isclass(target):
        app.add_middleware(target)
    else:
        app.middleware("http")(target)


def build_app(state: ServerState) -> FastAPI:
    """A FastAPI app serving the surfaces ``state.settings.apis`` selects (all by default),
    ``/docs`` from local assets, and 404/405 in the format of the API a path belongs to."""
    docs = not state.settings.disable_fastapi_docs
    app = FastAPI(title="Sonar", version=__version__, description=DESCRIPTION, docs_url=None, redoc_url=None, openapi_url="/openapi.json" if docs else None)
    if docs:
        install_docs(app)
    cors = state.settings.cors
    app.add_middleware(
        CORSMiddleware, allow_origins=cors.allowed_origins, allow_credentials=cors.allow_credentials,
        allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
    )  # fmt: skip
    for path in state.settings.middleware:
        add_middleware(app, path)
    install_route_errors(app)
    app.state.sonar = state
    surfaces = api_surfaces()
    selected = state.settings.apis or list(surfaces)
    unknown = [name for name in selected if name not in surfaces]
    if unknown:
        raise ValueError(f"unknown API surface(s) {unknown}; registered: {sorted(surfaces)}")
    for name in selected:
        surfaces[name](app, state)
    state.enabled_apis = list(selected)
    return app
