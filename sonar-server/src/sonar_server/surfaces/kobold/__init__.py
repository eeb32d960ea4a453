"""The KoboldAI API surface, as KoboldCpp serves it and SillyTavern calls it.

A generation's genkey and text live in the API server process that admitted it. With several
API servers a ``check`` or ``abort`` may land on another one, which asks its peers
(``sonar_server.peers``); a genkey is also refused when a peer is generating under it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from sonar_server import __version__
from sonar_server.errors import ApiError, to_api_error
from sonar_server.generation import Generation, start_generation
from sonar_server.peers import PeerAnswer
from sonar_server.prompts import encode_prompt
from sonar_server.routing import surface_router
from sonar_server.state import ServerState
from sonar_server.streaming import EventStreamResponse, sse_event, unless_disconnected
from sonar_server.strict_json import StrictJSONResponse
from sonar_server.surfaces.kobold.context import kobold_prompt_ids
from sonar_server.surfaces.kobold.protocol import GenerateRequest, GenkeyRequest, TokenCountRequest
from sonar_server.surfaces.kobold.sampling import kobold_sampling_params

API = "kobold.generate"
KOBOLD_API_VERSION = "1.2.5"
KOBOLDCPP_COMPAT_VERSION = "1.80"


def render_error(error: ApiError) -> StrictJSONResponse:
    """KoboldAI's format: ``{"detail": {"msg": ..., "type": ...}}``."""
    return StrictJSONResponse({"detail": {"msg": error.message, "type": error.kind}}, status_code=error.status)


def _jobs(state: ServerState) -> dict[str, Generation]:
    return state.surface_data.setdefault("kobold", {})


def _anonymous(state: ServerState) -> set[str]:
    """The keys of the running jobs whose requests named no genkey (the server made one up)."""
    return state.surface_data.setdefault("kobold_anonymous", set())


def _forget(state: ServerState, genkey: str) -> None:
    _jobs(state).pop(genkey, None)
    _anonymous(state).discard(genkey)


def _unnamed_jobs(state: ServerState) -> list[Generation]:
    """What a check or abort that names no genkey reaches: only jobs started without one (as a
    single-user client runs them), never a job whose client named its genkey, so on a server
    many clients share nobody reads or stops another's named generation."""
    jobs, anonymous = _jobs(state), _anonymous(state)
    return [jobs[key] for key in anonymous if key in jobs]


async def _start(body: GenerateRequest, state: ServerState) -> tuple[str, Generation]:
    arrival = time.monotonic()
    lora_request = await state.resolve_model(body.model)
    max_length = body.max_length if body.max_length is not None else state.settings.kobold_default_max_length
    params = kobold_sampling_params(body, max_length, state.vocab_size)
    prompt_ids, prompt_text = await kobold_prompt_ids(state, body.prompt, body.memory, body.max_context_length, max_length)
    genkey = body.genkey or f"KCPP{uuid.uuid4().hex[:8]}"
    jobs = _jobs(state)
    if genkey in jobs or (body.genkey and await state.peers.ask("kobold.running", genkey)):
        raise ApiError(400, f"genkey {genkey!r} is already generating")
    generation = await start_generation(state, API, state.new_request_id("kobold"), prompt_ids, params, arrival, prompt_text, lora_request=lora_request)
    jobs[genkey] = generation
    if not body.genkey:
        _anonymous(state).add(genkey)
    return genkey, generation


async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    genkey, generation = await _start(body, state)
    try:
        await unless_disconnected(request, generation.collect())
    finally:
        _forget(state, genkey)
    return {"results": [{"text": c.text, "finish_reason": c.finish_reason} for c in generation.choices]}


async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    state: ServerState = request.app.state.sonar
    genkey, generation = await _start(body, state)

    async def on_close() -> None:
        await generation.close()
        _forget(state, genkey)

    return EventStreamResponse(_stream(state, genkey, generation), on_close)


async def _stream(state: ServerState, genkey: str, generation: Generation) -> AsyncIterator[str]:
    deltas = generation.deltas()
    try:
        async for changed in deltas:
            for delta in changed:
                if delta.index != 0:
                    continue
                if delta.text:
                    yield sse_event("message", {"token": delta.text})
                if delta.finish_reason is not None:
                    yield sse_event("message", {"token": "", "finish_reason": delta.finish_reason})
    except Exception as exc:
        error = to_api_error(exc)
        yield sse_event("error", {"detail": {"msg": error.message, "type": error.kind}})
    finally:
        await deltas.aclose()
        await generation.close()
        _forget(state, genkey)


async def check(request: Request, body: GenkeyRequest | None = None) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    if body and body.genkey:
        answer = _check_named(state, body.genkey)
        if not answer.found:
            answer = next(iter(await state.peers.ask("kobold.check", body.genkey)), answer)
    else:
        answers = [_check_unnamed(state), *await state.peers.ask("kobold.check_unnamed")]
        held = [a for a in answers if a.count]
        answer = held[0] if len(held) == 1 and held[0].count == 1 else PeerAnswer()
    return {"results": [{"text": answer.text}]}


async def abort(request: Request, body: GenkeyRequest | None = None) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    if body and body.genkey:
        aborted = _abort_named(state, body.genkey).found or bool(await state.peers.ask("kobold.abort", body.genkey))
    else:
        here = _abort_unnamed(state).found
        aborted = bool(await state.peers.ask("kobold.abort_unnamed")) or here  # every API server's, always asked
    return {"success": "true" if aborted else "false", "done": "true"}


def _check_named(state: ServerState, genkey: str | None) -> PeerAnswer:
    generation = _jobs(state).get(genkey) if genkey else None
    if generation is None:
        return PeerAnswer()
    return PeerAnswer(found=True, count=1, text=generation.choices[0].text)


def _check_unnamed(state: ServerState, _key: str | None = None) -> PeerAnswer:
    unnamed = _unnamed_jobs(state)
    text = unnamed[0].choices[0].text if len(unnamed) == 1 else ""
    return PeerAnswer(found=bool(unnamed), count=len(unnamed), text=text)


def _running(state: ServerState, genkey: str | None) -> PeerAnswer:
    return PeerAnswer(found=bool(genkey) and genkey in _jobs(state))


def _abort_named(state: ServerState, genkey: str | None) -> PeerAnswer:
    generation = _jobs(state).get(genkey) if genkey else None
    if generation is not None:
        state.client.abort(generation.request_id)
    return PeerAnswer(found=generation is not None)


def _abort_unnamed(state: ServerState, _key: str | None = None) -> PeerAnswer:
    unnamed = _unnamed_jobs(state)
    for generation in unnamed:
        state.client.abort(generation.request_id)
    return PeerAnswer(found=bool(unnamed), count=len(unnamed))


async def token_count(body: TokenCountRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    token_ids = await encode_prompt(state, body.prompt)
    return {"value": len(token_ids), "ids": token_ids}


async def model(request: Request) -> dict[str, str]:
    state: ServerState = request.app.state.sonar
    return {"result": f"koboldcpp/{state.model_name}"}


async def max_context_length(request: Request) -> dict[str, int]:
    return {"value": request.app.state.sonar.max_model_len}


async def max_length(request: Request) -> dict[str, int]:
    return {"value": request.app.state.sonar.settings.kobold_default_max_length}


async def api_version() -> dict[str, str]:
    return {"result": KOBOLD_API_VERSION}


async def extra_version(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    return {"result": "KoboldCpp", "version": KOBOLDCPP_COMPAT_VERSION, "server": f"sonar {__version__}", "protected": bool(state.settings.api_keys)}


def install(app: FastAPI, state: ServerState) -> None:
    """Add the KoboldAI routes to ``app``; the version routes stay open so clients can probe."""
    work = surface_router(render_error, guarded=True, tags=["KoboldAI"])
    work.add_api_route("/api/v1/generate", generate, methods=["POST"], summary="Generate (blocks until done)")
    work.add_api_route("/api/extra/generate/stream", generate_stream, methods=["POST"], summary="Generate, streamed as SSE `message` events")
    work.add_api_route("/api/extra/generate/check", check, methods=["GET"], summary="Text generated so far")
    work.add_api_route("/api/extra/generate/check", check, methods=["POST"], name="check_post", summary="Text generated so far for a genkey")
    work.add_api_route("/api/extra/abort", abort, methods=["POST"], summary="Abort a generation by genkey")
    work.add_api_route("/api/extra/tokencount", token_count, methods=["POST"], summary="Count a prompt's tokens")
    work.add_api_route("/api/v1/model", model, methods=["GET"], summary="The served model")
    work.add_api_route("/api/v1/config/max_context_length", max_context_length, methods=["GET"], summary="The context length")
    work.add_api_route("/api/v1/config/max_length", max_length, methods=["GET"], summary="The default generation length")
    work.add_api_route("/api/extra/true_max_context_length", max_context_length, methods=["GET"], summary="The context length")
    app.include_router(work)
    open_routes = surface_router(render_error, guarded=False, tags=["KoboldAI"])
    open_routes.add_api_route("/api/v1/info/version", api_version, methods=["GET"], summary="KoboldAI API version")
    open_routes.add_api_route("/api/extra/version", extra_version, methods=["GET"], summary="Server identity and version")
    app.include_router(open_routes)
    for op, handler in (
        ("kobold.running", _running), ("kobold.check", _check_named), ("kobold.check_unnamed", _check_unnamed),
        ("kobold.abort", _abort_named), ("kobold.abort_unnamed", _abort_unnamed),
    ):  # fmt: skip
        state.peers.handle(op, lambda key, handler=handler: handler(state, key))
