"""The ``sonar proxy`` app: each request prefilled on one server, decoded on another (see
``sonar_server.proxy``)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("sonar_server.proxy")

_FORWARDED_HEADERS = ("authorization", "x-api-key")


@dataclass(slots=True, eq=False)
class Upstream:
    url: str
    in_flight: int = 0


class Pool:
    """Servers of one kind; ``pick`` takes the least loaded."""

    def __init__(self, urls: list[str]) -> None:
        self.servers = [Upstream(url.rstrip("/")) for url in urls]

    def pick(self) -> Upstream:
        return min(self.servers, key=lambda server: server.in_flight)


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0) -> Any:
    """The proxy's ASGI app."""
    prefill, decode = Pool(prefill_urls), Pool(decode_urls)
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
        yield
        await state["client"].aclose()

    app = FastAPI(title="sonar proxy", lifespan=lifespan)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "proxy_error", "code": status}}, status_code=status)

    async def route(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        client = state["client"]
        headers = {name: value for name, value in request.headers.items() if name.lower() in _FORWARDED_HEADERS}
        if body.get("n", 1) != 1:  # one prefill cannot serve several choices: decoded as a whole
            return await relay_to(decode.pick(), client, path, body, headers)
        # prefill: one token, not streamed, its blocks kept for the decode server
        prefill_body = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        server = prefill.pick()
        server.in_flight += 1
        try:
            answer = await client.post(server.url + path, json=prefill_body, headers=headers)
        except httpx.HTTPError as exc:
            return error(502, f"prefill server {server.url} did not answer: {exc}")
        finally:
            server.in_flight -= 1
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))
        params = answer.json().get("kv_transfer_params")
        if params is None:
            logger.warning("prefill server %s returned no kv_transfer_params (is it a kv_producer?); the decode server computes the prompt", server.url)
        return await relay_to(decode.pick(), client, path, {**body, "kv_transfer_params": params}, headers)

    async def relay_to(server: Upstream, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The server's answer to ``body``, streamed back as it comes when the body streams."""
        server.in_flight += 1
        upstream = client.build_request("POST", server.url + path, json=body, headers=headers)
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            server.in_flight -= 1
            return error(502, f"decode server {server.url} did not answer: {exc}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()
                server.in_flight -= 1

        if not body.get("stream"):
            try:
                content = await reply.aread()
            finally:
                await reply.aclose()
                server.in_flight -= 1
            return Response(content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))
        return StreamingResponse(relay(), status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {name: value for name, value in request.headers.items() if name.lower() in _FORWARDED_HEADERS}
        server = decode.pick()
        try:
            answer = await state["client"].get(server.url + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return error(502, f"decode server {server.url} did not answer: {exc}")
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "prefill": [{"url": s.url, "in_flight": s.in_flight} for s in prefill.servers],
            "decode": [{"url": s.url, "in_flight": s.in_flight} for s in decode.servers],
        }

    return app
