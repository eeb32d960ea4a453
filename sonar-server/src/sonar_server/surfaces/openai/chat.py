"""``POST /v1/chat/completions``: chat template, streaming with usage, logprobs, n."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from sonar.structured_output import GuidedDecodingParams
from starlette.requests import Request
from starlette.responses import Response

from sonar_server.errors import ApiError, to_api_error
from sonar_server.beam import beam_params, run_beam_search
from sonar_server.generation import Generation, closer, logprob_entries, start_generation
from sonar_server.parsers import StreamEvent
from sonar_server.prompts import render_chat
from sonar_server.sampling import build_sampling_params, extra_sampling_fields
from sonar_server.state import ServerState
from sonar_server.streaming import EventStreamResponse, sse_data, unless_disconnected
from sonar_server.strict_json import built_response
from sonar_server.structured import body_guide
from sonar_server.surfaces.openai.errors import error_body
from sonar_server.surfaces.openai.logprobs import chat_logprobs, prompt_logprobs_json, tokens_as_ids
from sonar_server.surfaces.openai.protocol import ChatCompletionRequest, ChatMessage
from sonar_server.tool_calling import (
    ToolPlan,
    openai_tool_plan,
    output_parser,
    template_message_tool_calls,
)

API = "openai.chat"


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content only, ``developer`` as ``system``."""
    result = []
    for number, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{number}]: content parts of type {part.type!r} are not supported; send text", param="messages")
                texts.append(part.text)
            content = "".join(texts)
        entry = message.model_dump(exclude_none=True)
        entry["role"] = "system" if message.role == "developer" else message.role
        entry["content"] = content or ""
        if "tool_calls" in entry and not isinstance(entry["tool_calls"], list):
            raise ApiError(400, f"messages[{number}].tool_calls must be a list, got {type(entry['tool_calls']).__name__}", param="messages")
        if "tool_calls" in entry:
            try:
                entry["tool_calls"] = template_message_tool_calls(entry["tool_calls"])
            except ValueError as exc:
                raise ApiError(400, f"messages[{number}].{exc}", param="messages") from None
        result.append(entry)
    return result


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.sonar
    lora_request = await state.resolve_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.stream and extra_sampling_fields(body).get("prompt_logprobs") is not None:  # as vLLM: a chat stream has no place for them
        raise ApiError(400, "prompt_logprobs are not available with stream=true; ask for them without streaming", param="prompt_logprobs")
    plan, prompt_text, prompt_ids = await render_chat_request(state, body, body.tool_choice, body.parallel_tool_calls, for_generation=True)
    guide = plan.constraint(body_guide(body, body.response_format))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(state.max_model_len - len(prompt_ids), 1)
    params = build_sampling_params(
        body,
        defaults=state.settings.default_sampling,
        vocab_size=state.vocab_size,
        mapped={
            "n": body.n,
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": body.stop,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "seed": body.seed,
            "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
            "logit_bias": body.logit_bias,
            "kv_transfer_params": body.kv_transfer_params,
            "guided_decoding": guide,
            "skip_special_tokens": False if plan.needs_special_tokens else None,
        },
    )
    request_id = state.new_request_id("chatcmpl")
    echoed = _echoed(state, body)
    if body.use_beam_search:
        found = await unless_disconnected(request, run_beam_search(state, API, request_id, prompt_ids, beam_params(body, params, state), arrival, body.priority, lora_request))
        return await built_response(lambda: _response(state, body, found, plan, guide, echoed), logprob_entries([found]))
    generation = await start_generation(state, API, request_id, prompt_ids, params, arrival, prompt_text, body.priority, lora_request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_stream(state, body, generation, include_usage, plan, guide, echoed), closer([generation]))
    await unless_disconnected(request, generation.collect())
    return await built_response(lambda: _response(state, body, generation, plan, guide, echoed), logprob_entries([generation]))


async def render_chat_request(
    state: ServerState, body: Any, tool_choice: Any, parallel_tool_calls: bool | None, for_generation: bool = False
) -> tuple[ToolPlan, str, list[int]]:
    """A chat body's tool plan and prompt (text and ids): its messages, tools, chat template
    and template variables, as a chat completion renders them (``/tokenize`` counts the same;
    ``for_generation``: see ``render_chat``)."""
    plan = openai_tool_plan(body.tools, tool_choice, parallel_tool_calls, state.settings)
    await asyncio.to_thread(plan.adapt_to, state.require_tokenizer())
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.chat_template is not None:
        template_kwargs["chat_template"] = body.chat_template
    messages = plan.render_inputs(message_dicts(body.messages), template_kwargs)
    prompt_text, prompt_ids = await render_chat(state, messages, body.add_generation_prompt, body.continue_final_message, template_kwargs, for_generation)
    return plan, prompt_text, prompt_ids


def _reply_role(state: ServerState, body: ChatCompletionRequest) -> str:
    """The reply's role: ``--response-role`` after a generation prompt, else the last
    message's own (the reply continues it), as vLLM names it."""
    continued = body.continue_final_message or not body.add_generation_prompt
    return body.messages[-1].role if continued and body.messages else state.settings.response_role


def _echoed(state: ServerState, body: ChatCompletionRequest) -> str:
    """With ``echo``: the text each reply starts with, the last message's content where that
    message has the reply's role, as vLLM echoes it."""
    if not body.echo or not body.messages:
        return ""
    last = body.messages[-1]
    if _reply_role(state, body) != last.role:
        return ""
    if isinstance(last.content, list):
        return "".join(part.text or "" for part in last.content)
    return last.content or ""


def _usage(generation: Generation) -> dict[str, int]:
    prompt_tokens = len(generation.prompt_token_ids)
    completion_tokens = generation.num_generated_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _message(state: ServerState, text: str, plan: ToolPlan, guide: GuidedDecodingParams | None, truncated: bool, role: str) -> dict[str, Any]:
    parsed = output_parser(plan, state.settings, guide).parse(text, truncated)
    message: dict[str, Any] = {"role": role, "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["content"] = parsed.content if parsed.content.strip() else None
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in parsed.tool_calls
        ]
    return message


def _finish_reason(finish_reason: str | None, message: dict[str, Any]) -> str | None:
    return "tool_calls" if message.get("tool_calls") and finish_reason == "stop" else finish_reason


def _response(
    state: ServerState, body: ChatCompletionRequest, generation: Generation, plan: ToolPlan, guide: GuidedDecodingParams | None, echoed: str = ""
) -> dict[str, Any]:
    choices = []
    as_ids, role = tokens_as_ids(state, body), _reply_role(state, body)
    for choice in generation.choices:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(state, choice.token_ids, list(choice.logprobs or []), body.top_logprobs or 0, as_ids)
        message = _message(state, choice.text, plan, guide, choice.finish_reason == "length", role)
        if echoed and message["content"] is not None:
            message["content"] = echoed + message["content"]
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(choice.finish_reason, message),
                "stop_reason": choice.stop_reason,
            }
        )
    response = {
        "id": generation.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model or state.model_name,
        "choices": choices,
        "usage": _usage(generation),
        "kv_transfer_params": generation.kv_transfer_params,
    }
    if "prompt_logprobs" in extra_sampling_fields(body):
        response["prompt_logprobs"] = prompt_logprobs_json(state, generation.prompt_logprobs)
    return response


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    generation: Generation,
    include_usage: bool,
    plan: ToolPlan,
    guide: GuidedDecodingParams | None,
    echoed: str = "",
) -> AsyncIterator[str | bytes]:
    created = int(time.time())
    model = body.model or state.model_name

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str | bytes:
        payload: dict[str, Any] = {"id": generation.request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        if any(c["finish_reason"] is not None for c in choices) and generation.kv_transfer_params is not None:
            payload["kv_transfer_params"] = generation.kv_transfer_params  # on the finishing chunk, as vLLM
        float_free = "kv_transfer_params" not in payload and all(c.get("logprobs") is None for c in choices)
        return sse_data(payload, float_free=float_free)

    deltas = generation.deltas()
    parsers = [output_parser(plan, state.settings, guide) for _ in range(body.n)]
    as_ids, role = tokens_as_ids(state, body), _reply_role(state, body)
    num_calls = [0] * body.n
    try:
        for index in range(body.n):
            yield chunk([{"index": index, "delta": {"role": role, "content": echoed}, "logprobs": None, "finish_reason": None}])
        async for changed in deltas:
            for delta in changed:
                logprobs = None
                if body.logprobs and delta.logprobs is not None:
                    logprobs = chat_logprobs(state, delta.token_ids, list(delta.logprobs), body.top_logprobs or 0, as_ids)
                events = parsers[delta.index].feed(delta.text)
                if delta.finish_reason is not None:
                    events += parsers[delta.index].finish(delta.finish_reason == "length")
                for number, event in enumerate(events):
                    yield chunk([{"index": delta.index, "delta": _event_delta(event), "logprobs": logprobs if number == 0 else None, "finish_reason": None}])
                    num_calls[delta.index] += event.kind == "tool_call"
                if not events and logprobs:
                    yield chunk([{"index": delta.index, "delta": {"content": ""}, "logprobs": logprobs, "finish_reason": None}])
                if delta.finish_reason is not None:
                    reason = "tool_calls" if num_calls[delta.index] and delta.finish_reason == "stop" else delta.finish_reason
                    yield chunk([{"index": delta.index, "delta": {}, "logprobs": None, "finish_reason": reason, "stop_reason": delta.stop_reason}])
        if include_usage:
            yield chunk([], _usage(generation))
    except Exception as exc:
        yield sse_data(error_body(to_api_error(exc)))
    finally:
        await deltas.aclose()
        await generation.close()
    yield "data: [DONE]\n\n"


def _event_delta(event: StreamEvent) -> dict[str, Any]:
    """One parsed stream event as an OpenAI chat ``delta``."""
    if event.kind == "reasoning":
        return {"reasoning_content": event.text}
    if event.kind == "tool_call" and event.call is not None:
        function = {"name": event.call.name, "arguments": event.text}
        return {"tool_calls": [{"index": event.index, "id": event.call.id, "type": "function", "function": function}]}
    if event.kind == "arguments":
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {"content": event.text}
