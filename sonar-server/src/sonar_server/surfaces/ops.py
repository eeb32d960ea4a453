"""The operations surface: ``/health``, ``/ping``, ``/version``, ``/metrics``. Open even when
API keys are set, so load balancers and Prometheus need no key."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from sonar_server import __version__
from sonar_server.errors import ApiError
from sonar_server.routing import surface_router
from sonar_server.state import ServerState
from sonar_server.strict_json import StrictJSONResponse as JSONResponse


def render_error(error: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": error.message, "type": error.kind, "code": error.status}}, status_code=error.status)


async def health(request: Request) -> Response:
    """200 when the engine can take requests (``degraded`` when some data-parallel replicas
    are dead or stuck and the others serve); 503 when none can, or the server is draining."""
    state: ServerState = request.app.state.sonar
    report = getattr(state.client, "health", None)
    if report is not None:
        body = report()
        if state.draining:
            body["status"] = "draining"
        return JSONResponse(body, status_code=200 if body["status"] in ("ok", "degraded") else 503)
    if not state.client.is_healthy():
        error = state.client.dead_error
        return JSONResponse({"status": "dead", "error": str(error) if error else "the engine thread stopped"}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ping(request: Request) -> Response:
    return await health(request)


async def version() -> dict[str, str]:
    from sonar import __version__ as core_version

    return {"version": core_version, "server_version": __version__}


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.sonar
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def install(app: FastAPI, state: ServerState) -> None:
    """Add the operations routes to ``app``."""
    router = surface_router(render_error, guarded=False, tags=["Operations"])
    router.add_api_route("/health", health, methods=["GET"], summary="Liveness: 503 when the engine is dead or draining")
    router.add_api_route("/ping", ping, methods=["GET"], summary="Same as /health")
    router.add_api_route("/ping", ping, methods=["POST"], name="ping_post", summary="Same as /health")
    router.add_api_route("/version", version, methods=["GET"], summary="Sonar's version")
    router.add_api_route("/metrics", metrics, methods=["GET"], summary="Prometheus metrics")
    app.include_router(router)
