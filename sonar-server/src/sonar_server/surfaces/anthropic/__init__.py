"""The Anthropic API surface: ``/v1/messages`` (plain and streaming) and
``/v1/messages/count_tokens``, errors in Anthropic's format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sonar_server.errors import ApiError, to_api_error
from sonar_server.generation import Generation, closer, start_generation
from sonar_server.prompts import render_chat
from sonar_server.routing import surface_router
from sonar_server.sampling import build_sampling_params
from sonar_server.state import ServerState
from sonar_server.streaming import EventStreamResponse, sse_event, unless_disconnected
from sonar_server.surfaces.anthropic.protocol import ContentBlock, CountTokensRequest, Message, MessagesRequest

API = "anthropic.messages"
_STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    kind = _STATUS_KINDS.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def render_error(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


def _text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.type != "text" or block.text is None:
            raise ApiError(400, f"{where}: content blocks of type {block.type!r} are not supported; send text blocks")
        texts.append(block.text)
    return "".join(texts)


def chat_messages(system: str | list[ContentBlock] | None, messages: list[Message]) -> list[dict[str, str]]:
    """Anthropic's system + messages as a chat template's message list."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    result = []
    if system:
        result.append({"role": "system", "content": _text(system, "system")})
    for number, message in enumerate(messages):
        result.append({"role": message.role, "content": _text(message.content, f"messages.{number}.content")})
    return result


def _stop_reason(finish_reason: str | None, stop_reason: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


async def create_message(body: MessagesRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.sonar
    state.check_model(body.model)
    if body.tools:
        raise ApiError(400, "tools: tool use is not supported yet")
    prompt_text, prompt_ids = await render_chat(state, chat_messages(body.system, body.messages))
    stop_sequences = list(body.stop_sequences or [])
    params = build_sampling_params(
        body,
        {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": stop_sequences or None,
            "n": 1,
        },
    )
    message_id = state.new_request_id("msg")
    generation = await start_generation(state, API, message_id, prompt_ids, params, arrival, prompt_text)
    if body.stream:
        return EventStreamResponse(_stream(state, body, generation, stop_sequences), closer([generation]))
    await unless_disconnected(request, generation.collect())
    choice = generation.choices[0]
    stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences)
    return JSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": [{"type": "text", "text": choice.text}],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(choice.token_ids)},
        }
    )


async def _stream(state: ServerState, body: MessagesRequest, generation: Generation, stop_sequences: list[str]) -> AsyncIterator[str]:
    input_tokens = len(generation.prompt_token_ids)
    deltas = generation.deltas()
    try:
        yield sse_event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": generation.request_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                },
            },
        )
        yield sse_event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        finish_reason, stop_reason = None, None
        async for changed in deltas:
            for delta in changed:
                if delta.text:
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta.text}})
                if delta.finish_reason is not None:
                    finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reason, sequence = _stop_reason(finish_reason, stop_reason, stop_sequences)
        yield sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": input_tokens, "output_tokens": generation.num_generated_tokens},
            },
        )
        yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        yield sse_event("error", error_body(to_api_error(exc)))
    finally:
        await deltas.aclose()
        await generation.close()


async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state: ServerState = request.app.state.sonar
    state.check_model(body.model)
    _, token_ids = await render_chat(state, chat_messages(body.system, body.messages))
    return {"input_tokens": len(token_ids)}


def install(app: FastAPI, state: ServerState) -> None:
    """Add the Anthropic routes to ``app``."""
    router = surface_router(render_error, guarded=True, tags=["Anthropic"])
    router.add_api_route("/v1/messages", create_message, methods=["POST"], summary="Create a message (SSE events with stream=true)")
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], summary="Count a conversation's input tokens")
    app.include_router(router)
