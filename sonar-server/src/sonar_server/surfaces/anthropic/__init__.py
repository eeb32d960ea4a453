"""The Anthropic API surface: ``/v1/messages`` (plain and streaming) and
``/v1/messages/count_tokens``, errors in Anthropic's format."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from sonar_server.errors import ApiError, to_api_error
from sonar_server.generation import Generation, closer, start_generation
from sonar_server.parsers import StreamEvent
from sonar_server.prompts import render_chat
from sonar_server.routing import surface_router
from sonar_server.sampling import build_sampling_params
from sonar_server.state import ServerState
from sonar_server.streaming import EventStreamResponse, sse_event, unless_disconnected
from sonar_server.strict_json import StrictJSONResponse
from sonar_server.structured import body_guide
from sonar_server.surfaces.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
)
from sonar_server.tool_calling import (
    OutputParser,
    ParsedOutput,
    ToolPlan,
    anthropic_tool_plan,
    output_parser,
)

API = "anthropic.messages"
_STATUS_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    kind = _STATUS_KINDS.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def render_error(error: ApiError) -> StrictJSONResponse:
    return StrictJSONResponse(error_body(error), status_code=error.status)


def _text(content: str | list[ContentBlock] | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or a list of content blocks, got {type(content).__name__}")
    texts = []
    for block in content:
        if not isinstance(block, (dict, ContentBlock)):
            raise ApiError(400, f"{where}: content blocks are objects, got {type(block).__name__}")
        block_type = block.get("type") if isinstance(block, dict) else block.type
        text = block.get("text") if isinstance(block, dict) else block.text
        if block_type != "text":
            raise ApiError(400, f"{where}: content blocks of type {block_type!r} are not supported here; send text blocks")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}: a text block's text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "".join(texts)


def _message_entries(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages: text, assistant tool calls, tool results."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        extra = block.model_extra or {}
        if block.type == "text":
            if not isinstance(block.text, str):
                raise ApiError(400, f"{where}.{number}: a text block's text must be a string, got {type(block.text).__name__}")
            texts.append(block.text)
        elif block.type == "tool_use":
            name, arguments = extra.get("name"), extra.get("input", {})
            if not isinstance(name, str) or not name:
                raise ApiError(400, f"{where}.{number}: a tool_use block needs a name")
            if not isinstance(arguments, dict):
                raise ApiError(400, f"{where}.{number}: a tool_use block's input must be an object, got {type(arguments).__name__}")
            function = {"name": name, "arguments": arguments}
            tool_calls.append({"id": extra.get("id", ""), "type": "function", "function": function})
        elif block.type == "tool_result":
            content = extra.get("content")
            text = _text(content, f"{where}.{number}.content") if content is not None else ""
            results.append({"role": "tool", "tool_call_id": extra.get("tool_use_id", ""), "content": text})
        elif block.type not in ("thinking", "redacted_thinking"):  # earlier reasoning is not replayed
            raise ApiError(400, f"{where}.{number}: content blocks of type {block.type!r} are not supported")
    entries: list[dict[str, Any]] = []
    if texts or tool_calls or not results:
        entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if tool_calls:
            entry["tool_calls"] = tool_calls
        entries.append(entry)
    return results + entries if message.role == "user" else entries + results


def chat_messages(system: str | list[ContentBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic's system + messages as a chat template's message list."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required")
    result: list[dict[str, Any]] = []
    if system:
        result.append({"role": "system", "content": _text(system, "system")})
    for number, message in enumerate(messages):
        result.extend(_message_entries(message, f"messages.{number}.content"))
    return result


def _stop_reason(finish_reason: str | None, stop_reason: Any, stop_sequences: list[str], tool_use: bool = False) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return ("tool_use" if tool_use else "end_turn"), None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _content_blocks(parsed: ParsedOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content.strip() or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": call.input})
    return blocks


async def create_message(body: MessagesRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.sonar
    lora_request = await state.resolve_model(body.model)
    plan, prompt_text, prompt_ids = await _render(state, body.system, body.messages, body.tools, body.tool_choice, for_generation=True)
    guide = plan.constraint(body_guide(body))
    stop_sequences = list(body.stop_sequences or [])
    params = build_sampling_params(
        body,
        defaults=state.settings.default_sampling,
        vocab_size=state.vocab_size,
        mapped={
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": stop_sequences or None,
            "n": 1,
            "guided_decoding": guide,
            "skip_special_tokens": False if plan.needs_special_tokens else None,
        },
    )
    message_id = state.new_request_id("msg")
    generation = await start_generation(state, API, message_id, prompt_ids, params, arrival, prompt_text, lora_request=lora_request)
    if body.stream:
        parser = output_parser(plan, state.settings, guide)
        return EventStreamResponse(_stream(state, body, generation, stop_sequences, parser), closer([generation]))
    await unless_disconnected(request, generation.collect())
    choice = generation.choices[0]
    parsed = output_parser(plan, state.settings, guide).parse(choice.text, choice.finish_reason == "length")
    stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences, bool(parsed.tool_calls))
    return StrictJSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": _content_blocks(parsed),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(choice.token_ids)},
        }
    )


async def _stream(
    state: ServerState, body: MessagesRequest, generation: Generation, stop_sequences: list[str], parser: OutputParser
) -> AsyncIterator[str]:
    input_tokens = len(generation.prompt_token_ids)
    deltas = generation.deltas()
    blocks = _BlockWriter()
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
        finish_reason, stop_reason = None, None
        async for changed in deltas:
            for delta in changed:
                events = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
                    events += parser.finish(delta.finish_reason == "length")
                for event in events:
                    for line in blocks.write(event):
                        yield line
        for line in blocks.close():
            yield line
        reason, sequence = _stop_reason(finish_reason, stop_reason, stop_sequences, blocks.num_tool_uses > 0)
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


class _BlockWriter:
    """Parsed stream events as Anthropic content blocks: one block per run of thinking, text or
    one tool use, each opened, filled with deltas and closed in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None
        self.num_tool_uses = 0

    def write(self, event: StreamEvent) -> list[str]:
        lines: list[str] = []
        if event.kind == "tool_call" and event.call is not None:
            self.num_tool_uses += 1
            block = {"type": "tool_use", "id": _tool_use_id(event.call.id), "name": event.call.name, "input": {}}
            lines += self._open("tool_use", block, force=True)
            lines += self._delta({"type": "input_json_delta", "partial_json": event.text})
        elif event.kind == "arguments":
            lines += self._delta({"type": "input_json_delta", "partial_json": event.text})
        elif event.kind == "reasoning" and event.text:
            lines += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            lines += self._delta({"type": "thinking_delta", "thinking": event.text})
        elif event.kind == "content" and event.text:
            lines += self._open("text", {"type": "text", "text": ""})
            lines += self._delta({"type": "text_delta", "text": event.text})
        return lines

    def close(self) -> list[str]:
        lines = [] if self.index >= 0 else self._open("text", {"type": "text", "text": ""})
        return lines + self._close()

    def _open(self, block_type: str, block: dict[str, Any], force: bool = False) -> list[str]:
        if self.open_type == block_type and not force:
            return []
        lines = self._close()
        self.index += 1
        self.open_type = block_type
        return lines + [sse_event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        return [sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def _close(self) -> list[str]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def _render(
    state: ServerState, system: Any, messages: list[Message], tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None,
    for_generation: bool = False,
) -> tuple[ToolPlan, str, list[int]]:
    """The request's tool plan and its prompt (text and ids): the tools where the plan puts
    them, and a final assistant message continued (Anthropic's prefill: the reply goes on from
    its text) rather than closed (``for_generation``: see ``render_chat``)."""
    plan = anthropic_tool_plan(tools, tool_choice, state.settings)
    await asyncio.to_thread(plan.adapt_to, state.require_tokenizer())
    template_kwargs: dict[str, Any] = {}
    rendered = plan.render_inputs(chat_messages(system, messages), template_kwargs)
    final = rendered[-1] if rendered else {}
    prefill = final.get("role") == "assistant" and isinstance(final.get("content"), str) and bool(final["content"]) and not final.get("tool_calls")
    prompt_text, prompt_ids = await render_chat(state, rendered, continue_final_message=prefill, template_kwargs=template_kwargs, for_generation=for_generation)
    return plan, prompt_text, prompt_ids


async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state: ServerState = request.app.state.sonar
    await state.resolve_model(body.model)
    _, _, token_ids = await _render(state, body.system, body.messages, body.tools, body.tool_choice)
    return {"input_tokens": len(token_ids)}


def install(app: FastAPI, state: ServerState) -> None:
    """Add the Anthropic routes to ``app``."""
    router = surface_router(render_error, guarded=True, tags=["Anthropic"])
    router.add_api_route("/v1/messages", create_message, methods=["POST"], summary="Create a message (SSE events with stream=true)")
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], summary="Count a conversation's input tokens")
    app.include_router(router)
