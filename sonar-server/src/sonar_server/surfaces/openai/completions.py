"""``POST /v1/completions``: string, list and token-id prompts, streaming, echo, logprobs, n."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sonar_server.errors import ApiError, to_api_error
from sonar_server.beam import beam_params, run_beam_search
from sonar_server.generation import Generation, closer, logprob_entries, start_generation
from sonar_server.json_closer import closing_suffix
from sonar_server.prompts import decode_tokens, encode_prompt
from sonar_server.sampling import build_sampling_params, extra_sampling_fields
from sonar_server.state import ServerState
from sonar_server.streaming import EventStreamResponse, merge, sse_data, unless_disconnected
from sonar_server.strict_json import built_response
from sonar_server.structured import body_guide
from sonar_server.surfaces.openai.errors import error_body
from sonar_server.surfaces.openai.logprobs import completion_logprobs, prompt_logprobs_json, tokens_as_ids
from sonar_server.surfaces.openai.protocol import CompletionRequest

API = "openai.completions"


async def _prompts(state: ServerState, prompt: Any, n: int) -> list[tuple[str | None, list[int]]]:
    """``(text, token ids)`` per prompt; text is None for token-id prompts. The prompts' count
    times ``n`` (the sequences they ask for) is checked before any is tokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompt) > 1 and n * len(prompt) > state.settings.max_n:
        raise ApiError(
            400, f"{len(prompt)} prompts with n={n} ask for {n * len(prompt)} sequences; this server's limit is {state.settings.max_n} (--max-num-seqs)",
            param="prompt",
        )
    result = []
    for item in prompt:
        if isinstance(item, str):
            result.append((item, await encode_prompt(state, item, for_generation=True)))
        else:
            result.append((None, list(item)))
    return result


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state: ServerState = request.app.state.sonar
    lora_request = await state.resolve_model(body.model)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:  # as vLLM's V1 engine: n candidates are the n choices
        raise ApiError(400, f"best_of={body.best_of} is not supported (only best_of equal to n={body.n}); ask for n choices instead", param="best_of")
    prompts = await _prompts(state, body.prompt, max(body.n, 1))
    echo_logprobs = body.echo and body.logprobs is not None
    params = build_sampling_params(
        body,
        defaults=state.settings.default_sampling,
        vocab_size=state.vocab_size,
        mapped={
            "n": body.n,
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": body.stop,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "seed": body.seed,
            "logprobs": body.logprobs,
            "prompt_logprobs": body.logprobs if echo_logprobs else None,
            "logit_bias": body.logit_bias,
            "kv_transfer_params": body.kv_transfer_params,
            "guided_decoding": body_guide(body, body.response_format),
        },
    )
    state.check_n(params.n * len(prompts))
    request_id = state.new_request_id("cmpl")
    if body.use_beam_search:
        beams = beam_params(body, params, state)
        searches = [run_beam_search(state, API, f"{request_id}-{i}", ids, beams, arrival, body.priority, lora_request) for i, (_, ids) in enumerate(prompts)]
        found = await unless_disconnected(request, asyncio.gather(*searches))
        echoes = [await _echo_text(state, text, ids) if body.echo else "" for text, ids in prompts]
        return await built_response(lambda: _response(state, body, request_id, found, echoes), logprob_entries(found))
    generations: list[Generation] = []
    try:
        for i, (text, token_ids) in enumerate(prompts):
            generations.append(await start_generation(state, API, f"{request_id}-{i}", token_ids, params, arrival, text, body.priority, lora_request))
    except BaseException:
        for generation in generations:
            await generation.close()
        raise
    echo_texts = [await _echo_text(state, text, ids) if body.echo else "" for text, ids in prompts]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_stream(state, body, request_id, generations, echo_texts, include_usage), closer(generations))
    await unless_disconnected(request, asyncio.gather(*(g.collect() for g in generations)))
    return await built_response(lambda: _response(state, body, request_id, generations, echo_texts), logprob_entries(generations))


def _closes_json(body: CompletionRequest) -> bool:
    return bool(body.response_format) and body.response_format.get("type") == "json_object"


def _json_closing(body: CompletionRequest, text: str, finish_reason: str | None) -> str:
    """What closes a ``json_object`` completion that ``max_tokens`` cut short (as on chat)."""
    if finish_reason != "length" or not _closes_json(body):
        return ""
    return closing_suffix(text) or ""


async def _echo_text(state: ServerState, text: str | None, token_ids: list[int]) -> str:
    return text if text is not None else await decode_tokens(state, token_ids)


def _usage(generations: list[Generation]) -> dict[str, int]:
    prompt_tokens = sum(len(g.prompt_token_ids) for g in generations)
    completion_tokens = sum(g.num_generated_tokens for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _response(
    state: ServerState, body: CompletionRequest, request_id: str, generations: list[Generation], echo_texts: list[str]
) -> dict[str, Any]:
    choices = []
    wants_prompt_logprobs = "prompt_logprobs" in extra_sampling_fields(body)  # asked for (echo's own go into logprobs)
    as_ids = tokens_as_ids(state, body)
    for position, generation in enumerate(generations):
        echo = echo_texts[position]
        for choice in generation.choices:
            logprobs = None
            if body.logprobs is not None:
                # the generated tokens' offsets count from the echoed text's end (a prompt token's
                # own string may be a piece of a character, shorter or longer than its text)
                logprobs = completion_logprobs(state, list(choice.token_ids), list(choice.logprobs or []), body.logprobs, len(echo), as_ids)
                if body.echo:
                    logprobs = _joined(_prompt_logprobs(state, body, generation, as_ids), logprobs)
            entry = {
                "index": position * body.n + choice.index,
                "text": echo + choice.text + _json_closing(body, choice.text, choice.finish_reason),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if wants_prompt_logprobs:
                entry["prompt_logprobs"] = prompt_logprobs_json(state, generation.prompt_logprobs)
            choices.append(entry)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or state.model_name,
        "choices": choices,
        "usage": _usage(generations),
        "kv_transfer_params": generations[0].kv_transfer_params if len(generations) == 1 else None,
    }


def _prompt_logprobs(state: ServerState, body: CompletionRequest, generation: Generation, as_ids: bool) -> dict[str, Any]:
    """An echoed prompt's tokens in the legacy logprobs format (the first token's logprob None)."""
    entries = list(generation.prompt_logprobs or [])
    entries += [None] * (len(generation.prompt_token_ids) - len(entries))
    return completion_logprobs(state, generation.prompt_token_ids, entries, body.logprobs, 0, as_ids)


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    request_id: str,
    generations: list[Generation],
    echo_texts: list[str],
    include_usage: bool,
) -> AsyncIterator[str | bytes]:
    created = int(time.time())
    model = body.model or state.model_name
    text_offsets: dict[int, int] = {}
    texts: dict[int, str] = {}  # the generated text so far, for closing a json_object cut short
    closes_json = _closes_json(body)

    def chunk(
        index: int, text: str, logprobs: Any = None, finish_reason: str | None = None, stop_reason: Any = None, prompt_logprobs: Any = None
    ) -> str | bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        payload: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        if finish_reason is not None and len(generations) == 1 and generations[0].kv_transfer_params is not None:
            payload["kv_transfer_params"] = generations[0].kv_transfer_params  # on the finishing chunk, as vLLM
        return sse_data(payload, float_free=logprobs is None and "kv_transfer_params" not in payload)

    merged = merge([g.deltas() for g in generations])
    echo_waits = body.logprobs is not None  # the echo goes with the first delta: the prompt's logprobs come with it
    try:
        for position, echo in enumerate(echo_texts):
            for j in range(body.n):
                if echo:
                    text_offsets[position * body.n + j] = len(echo)
                    if not echo_waits:
                        yield chunk(position * body.n + j, echo)
        echoed: set[int] = set()
        wants_prompt_logprobs = "prompt_logprobs" in extra_sampling_fields(body)
        as_ids = tokens_as_ids(state, body)
        prompt_logprobs_sent: set[int] = set()  # asked-for prompt_logprobs go with each choice's first chunk, as vLLM
        async for position, deltas in merged:
            for delta in deltas:
                index = position * body.n + delta.index
                logprobs = None
                if body.logprobs is not None and delta.logprobs is not None:
                    logprobs = completion_logprobs(state, delta.token_ids, list(delta.logprobs), body.logprobs, text_offsets.get(index, 0), as_ids)
                text_offsets[index] = text_offsets.get(index, 0) + len(delta.text)
                text = delta.text
                if closes_json:
                    texts[index] = texts.get(index, "") + text
                    text += _json_closing(body, texts[index], delta.finish_reason)
                if echo_waits and body.echo and index not in echoed:
                    echoed.add(index)
                    prompt = _prompt_logprobs(state, body, generations[position], as_ids)
                    logprobs = prompt if logprobs is None else _joined(prompt, logprobs)
                    text = echo_texts[position] + text
                prompt_logprobs = None
                if wants_prompt_logprobs and index not in prompt_logprobs_sent:
                    prompt_logprobs_sent.add(index)
                    prompt_logprobs = prompt_logprobs_json(state, generations[position].prompt_logprobs)
                yield chunk(index, text, logprobs, delta.finish_reason, delta.stop_reason, prompt_logprobs)
        if include_usage:
            yield sse_data({"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": _usage(generations)})
    except Exception as exc:
        yield sse_data(error_body(to_api_error(exc)))
    finally:
        await merged.aclose()
        for generation in generations:
            await generation.close()
    yield "data: [DONE]\n\n"
