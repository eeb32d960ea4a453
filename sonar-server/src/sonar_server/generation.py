"""One engine request as an API sees it: text deltas per choice, metrics, one log line."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sonar.engine.async_client import RequestStream
from sonar.lora import LoRARequest
from sonar.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from sonar.sampling_params import SamplingParams, truncated_prompt
from sonar_server.state import ServerState

logger = logging.getLogger("sonar_server.requests")


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class ChoiceState:
    index: int
    text: str = ""  # streamed so far; the whole text once finished
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """Follows one request's cumulative outputs and hands out deltas that are safe to stream.

    Text that could still become part of a stop string (the last ``len(longest stop) - 1``
    characters) is held back until the request moves past it or finishes.

    :param state: the server state (metrics, logging).
    :param api: the API surface's name, for metrics and logs (``"openai.chat"``).
    :param stream: the engine client's stream for this request.
    :param params: the request's sampling parameters.
    :param prompt_token_ids: the prompt as the engine received it.
    :param arrival: ``time.monotonic()`` when the HTTP request arrived.
    """

    def __init__(
        self,
        state: ServerState,
        api: str,
        stream: RequestStream,
        params: SamplingParams,
        prompt_token_ids: list[int],
        arrival: float,
    ) -> None:
        self.state = state
        self.api = api
        self.stream = stream
        self.request_id = stream.request_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None  # the engine's KV connector's, once finished
        self.choices = [ChoiceState(i) for i in range(params.n)]
        self._holdback = max((len(s) for s in params.stop or ()), default=1) - 1
        self._arrival = arrival
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._closed = False

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas of every choice that progressed, one list per engine output; closing it
        early aborts the request."""
        try:
            async for output in self.stream:
                changed = self._update(output)
                if changed:
                    yield changed
        finally:
            await self.stream.aclose()
            self._close()

    async def close(self) -> None:
        """Abort the request if it has not finished, and record it (safe to call twice)."""
        await self.stream.aclose()
        self._close()

    async def collect(self) -> Generation:
        """Run to completion (non-streaming requests); ``choices`` then hold the whole texts."""
        async for _ in self.deltas():
            pass
        return self

    # -- internals -----------------------------------------------------------------------

    def _update(self, output: RequestOutput) -> list[ChoiceDelta]:
        now = time.monotonic()
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        completions = {c.index: c for c in output.outputs}
        deltas: list[ChoiceDelta] = []
        num_new_tokens = 0
        for choice in self.choices:
            if choice.finish_reason is not None:
                continue
            completion = completions.get(choice.index)
            if completion is None:
                if output.finished:  # aborted before this choice produced anything
                    choice.finish_reason = "abort"
                    deltas.append(ChoiceDelta(choice.index, "", [], [] if self.params.logprobs is not None else None, "abort"))
                continue
            finished = completion.finish_reason is not None or output.finished
            full_text = completion.text
            end = len(full_text) if finished else max(len(choice.text), len(full_text) - self._holdback)
            new_text = full_text[len(choice.text):end]
            new_ids = completion.token_ids[len(choice.token_ids):]
            new_logprobs = None
            if completion.logprobs is not None:
                start = len(choice.logprobs) if choice.logprobs is not None else 0
                new_logprobs = completion.logprobs[start:]
                choice.logprobs = completion.logprobs  # each output's lists are its own: kept, not copied
                choice.cumulative_logprob = completion.cumulative_logprob
            choice.text = full_text if finished else full_text[:end]
            choice.token_ids = completion.token_ids
            num_new_tokens += len(new_ids)
            if finished:
                choice.finish_reason = completion.finish_reason or "abort"
                choice.stop_reason = completion.stop_reason
            if new_text or new_ids or finished:
                deltas.append(
                    ChoiceDelta(choice.index, new_text, new_ids, new_logprobs, choice.finish_reason, choice.stop_reason)
                )
        self._observe_tokens(now, num_new_tokens)
        return deltas

    def _observe_tokens(self, now: float, num_new_tokens: int) -> None:
        if num_new_tokens == 0:
            return
        metrics = self.state.metrics
        if self._first_token_at is None:
            self._first_token_at = now
            metrics.observe_first_token(now - self._arrival)
            num_new_tokens -= 1
        if num_new_tokens > 0 and self._last_token_at is not None:
            metrics.observe_inter_token((now - self._last_token_at) / num_new_tokens, num_new_tokens)
        self._last_token_at = now

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for choice in self.choices:
            if choice.finish_reason is None:  # the consumer went away (client disconnect)
                choice.finish_reason = "abort"
        ttft = (self._first_token_at - self._arrival) if self._first_token_at is not None else None
        record_finished(self.state, self.api, self.request_id, self.choices, len(self.prompt_token_ids), self.num_cached_tokens, self._arrival, ttft)


def record_finished(
    state: ServerState, api: str, request_id: str, choices: list[ChoiceState], num_prompt_tokens: int, num_cached_tokens: int, arrival: float, ttft: float | None = None
) -> None:
    """Count one finished request in the metrics (by its first choice's finish reason) and
    write its log line."""
    e2e = time.monotonic() - arrival
    num_generated = sum(len(c.token_ids) for c in choices)
    finish_reason = (choices[0].finish_reason if choices else None) or "abort"
    state.metrics.observe_finished(api, finish_reason, num_prompt_tokens, num_generated, e2e)
    state.metrics.update_in_flight()
    logger.info(
        "%s %s finish=%s prompt_tokens=%d cached_tokens=%d generated_tokens=%d ttft=%s e2e=%.3fs",
        api,
        request_id,
        ",".join(sorted({c.finish_reason or "abort" for c in choices})) or "abort",
        num_prompt_tokens,
        num_cached_tokens,
        num_generated,
        f"{ttft:.3f}s" if ttft is not None else "-",
        e2e,
    )


async def start_generation(
    state: ServerState,
    api: str,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    arrival: float,
    prompt_text: str | None = None,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> Generation:
    """Admit a request into the engine (with ``lora_request``: through that adapter); raises
    ValueError (bad input), QueueFull or EngineDeadError before anything is streamed."""
    state.check_n(params.n)
    if params.truncate_prompt_tokens is not None:  # the engine runs the same cut: the usage and the outputs count it
        kept = truncated_prompt(prompt_token_ids, params.truncate_prompt_tokens, state.max_model_len)
        prompt_text, prompt_token_ids = (prompt_text if kept is prompt_token_ids else None), kept
    prompt: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
    if prompt_text is not None:
        prompt["prompt"] = prompt_text
    if state.settings.enable_log_requests:
        _log_request(state, request_id, prompt_token_ids, params, prompt_text, lora_request)
    stream = await state.client.add_request(request_id, prompt, params, priority, lora_request)
    state.metrics.update_in_flight()
    return Generation(state, api, stream, params, prompt_token_ids, arrival)


def _log_request(
    state: ServerState, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt_text: str | None, lora_request: LoRARequest | None
) -> None:
    """``--enable-log-requests``: one line per admitted request, prompt and ids cut to ``--max-log-len``."""
    limit = state.settings.max_log_len
    text = prompt_text if prompt_text is None or limit is None else prompt_text[:limit]
    ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
    logger.info(
        "received request %s: prompt %r, prompt_token_ids %s (%d tokens), params %s, lora %s",
        request_id, text, ids, len(prompt_token_ids), params, lora_request.lora_name if lora_request else None,
    )


def logprob_entries(generations: list[Generation]) -> int:
    """How many logprob entries finished ``generations`` hold (each position's chosen and top
    tokens, the prompt's too): what the size of a response that lists them grows with."""
    entries = 0
    for generation in generations:
        for choice in generation.choices:
            if choice.logprobs is not None:
                entries += sum(map(len, choice.logprobs))
        if generation.prompt_logprobs is not None:
            entries += sum(len(entry) for entry in generation.prompt_logprobs if entry is not None)
    return entries


def closer(generations: list[Generation]) -> Callable[[], Awaitable[None]]:
    """An ``on_close`` callback closing every generation of a response."""

    async def close() -> None:
        for generation in generations:
            await generation.close()

    return close


def decoded_token(state: ServerState, token_id: int, logprob: Logprob | None) -> str:
    """The text of one token, for logprob listings."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if state.tokenizer is None:
        return f"token_id:{token_id}"
    return state.tokenizer.decode([token_id])
