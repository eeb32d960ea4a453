"""``/docs``: Swagger UI over ``/openapi.json``, its JavaScript, CSS and icon served by Sonar
itself from the ``swagger-ui-bundle`` package, so the page works with no network."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"


def _assets_folder() -> str:
    import swagger_ui_bundle

    return swagger_ui_bundle.swagger_ui_path


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` and its assets under ``/docs/assets`` (the app must be
    built with ``docs_url=None``)."""
    app.mount(ASSETS_PATH, StaticFiles(directory=_assets_folder()), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} API",
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon-32x32.png",
        )

    app.add_api_route(DOCS_PATH, swagger_ui, methods=["GET"], include_in_schema=False)
