"""``use_beam_search`` on the OpenAI surfaces (vLLM's extension): ``n`` is the beam width and
the ``n`` choices are the best beams, best first (``sonar.beam_search``). Each step sends every
live beam to the engine as a one-token request; a client that goes away aborts the step in
flight. Not streamed: a beam's text is known only at the end."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from sonar.beam_search import BeamSearch, BeamSearchParams
from sonar.lora.request import LoRARequest
from sonar.outputs import RequestOutput
from sonar.sampling_params import SamplingParams

from sonar_server.errors import ApiError
from sonar_server.generation import ChoiceState, record_finished
from sonar_server.state import ServerState


class BeamGeneration:
    """A finished beam search, shaped as the responses read a ``Generation``."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], choices: list[ChoiceState]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.choices = choices
        self.prompt_logprobs = None
        self.kv_transfer_params = None
        self.num_cached_tokens = 0

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    async def close(self) -> None:
        """Nothing is left running once the search has returned."""


def beam_params(body: Any, params: SamplingParams, state: ServerState) -> BeamSearchParams:
    """The request's beam search, from its validated sampling parameters: ``n`` beams,
    ``max_tokens`` (None: up to the context), ``ignore_eos``, and the body's
    ``length_penalty``; a 400 for a streamed request (a beam's text is known only at the end)."""
    if body.stream:
        raise ApiError(400, "use_beam_search does not stream (a beam's text is known only at the end); send stream=false", param="stream")
    return BeamSearchParams(params.n, params.max_tokens or state.max_model_len, params.ignore_eos, length_penalty=body.length_penalty)


async def run_beam_search(
    state: ServerState,
    api: str,
    request_id: str,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    arrival: float,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> BeamGeneration:
    """The ``params.beam_width`` best beams after ``prompt_token_ids``, as ``n`` choices. The
    search counts as one request of ``api`` in the metrics (its steps' engine requests do not),
    an abort where it fails or its client goes away."""
    max_logprobs = getattr(getattr(state.client, "config", None), "max_logprobs", 20)
    if 2 * params.beam_width > max_logprobs:
        raise ApiError(400, f"beam search with n={params.beam_width} ranks {2 * params.beam_width} tokens a step, more than this server's --max-logprobs {max_logprobs}", param="n")
    if len(prompt_token_ids) >= state.max_model_len:
        raise ApiError(400, f"the prompt is {len(prompt_token_ids)} tokens, the model's context is {state.max_model_len} tokens: no room to generate")
    eos = set(getattr(state.client.model_config, "eos_token_ids", None) or ())
    search = BeamSearch([prompt_token_ids], params, eos, state.max_model_len)
    ids = itertools.count()
    admitted = False  # a search refused at its first step is not counted, as a refused request is not

    async def step(tokens: list[int]) -> RequestOutput:
        nonlocal admitted
        stream = await state.client.add_request(f"{request_id}-beam{next(ids)}", {"prompt_token_ids": tokens}, search.step_params, priority, lora_request)
        admitted = True
        state.metrics.update_in_flight()
        final = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()  # aborts it where the client went away first
        assert final is not None
        return final

    choices: list[ChoiceState] = []
    try:
        while not search.done:
            search.advance(await asyncio.gather(*(step(tokens) for tokens in search.prompts())))
        num_prompt = len(prompt_token_ids)
        tokenizer = state.tokenizer
        for index, beam in enumerate(search.results()[0].sequences):
            generated = beam.tokens[num_prompt:]
            text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
            choices.append(ChoiceState(index, text, generated, beam.logprobs, beam.cum_logprob, beam.finish_reason, beam.stop_reason))
    finally:
        if admitted:
            record_finished(state, api, request_id, choices, len(prompt_token_ids), 0, arrival)
    return BeamGeneration(request_id, prompt_token_ids, choices)
