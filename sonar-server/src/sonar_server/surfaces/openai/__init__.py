"""The OpenAI API surface: models, completions, chat completions, tokenize, detokenize; and,
with ``--allow-runtime-lora-updating``, vLLM's LoRA load and unload routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from sonar_server.errors import ApiError
from sonar_server.prompts import decode_tokens, encode_prompt
from sonar_server.routing import surface_router
from sonar_server.state import ServerState
from sonar_server.surfaces.openai.chat import create_chat_completion, render_chat_request
from sonar_server.surfaces.openai.completions import create_completion
from sonar_server.surfaces.openai.errors import render_error
from sonar_server.surfaces.openai.protocol import DetokenizeRequest, TokenizeRequest


async def list_models(request: Request) -> dict[str, Any]:
    """The served model's names, then each loaded LoRA adapter with the model as ``parent``."""
    state: ServerState = request.app.state.sonar
    adapters = await state.adapters.model_cards(state.started_at, state.max_model_len)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": state.started_at,
                "owned_by": "sonar",
                "root": state.model_path,
                "max_model_len": state.max_model_len,
            }
            for name in state.settings.served_model_names
        ]
        + adapters,
    }


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    await state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt or messages")
    if body.messages is not None:  # the prompt a chat completion with these fields renders
        _, _, token_ids = await render_chat_request(state, body, None, None)
    elif body.add_special_tokens:
        token_ids = await encode_prompt(state, body.prompt or "")
    else:
        token_ids = state.require_tokenizer().encode(body.prompt or "", add_special_tokens=False)
    return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids}


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.sonar
    await state.resolve_model(body.model)
    return {"prompt": await decode_tokens(state, body.tokens)}


def install(app: FastAPI, state: ServerState) -> None:
    """Add the OpenAI routes to ``app``."""
    router = surface_router(render_error, guarded=True, tags=["OpenAI"])
    router.add_api_route("/v1/models", list_models, methods=["GET"], summary="List the served models")
    router.add_api_route("/v1/completions", create_completion, methods=["POST"], summary="Text completion (SSE with stream=true)")
    router.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], summary="Chat completion (SSE with stream=true)")
    router.add_api_route("/tokenize", tokenize, methods=["POST"], summary="Token ids of a prompt or of chat messages")
    router.add_api_route("/detokenize", detokenize, methods=["POST"], summary="Text of token ids")
    if state.settings.allow_runtime_lora_updating:
        from sonar_server.surfaces.openai.lora_adapters import load_lora_adapter, unload_lora_adapter

        router.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"], summary="Load a LoRA adapter from --lora-root")
        router.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"], summary="Unload a LoRA adapter")
    app.include_router(router)
