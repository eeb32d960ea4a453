"""Beam search over the engine, as vLLM's ``LLM.beam_search`` runs it: each step asks the
engine for one token of every live beam with its ``2 * beam_width`` most likely tokens, and
keeps the ``beam_width`` best extensions by cumulative log-probability. A beam that ends in
EOS is complete. The prompts of a step share their prefixes with the step before, so the
prefix cache computes only each beam's new token.

Completed and live beams are ranked at the end by ``cum_logprob / len(tokens) **
length_penalty`` (the length counting the prompt and not a final EOS, as vLLM counts it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sonar.outputs import Logprob, RequestOutput
from sonar.sampling_params import SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's beam-search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # kept for vLLM's signature: beams are ranked by the model's log-probabilities
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # kept for vLLM's signature: beam search has no stop strings

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` (the prompt's, then the generated ones), each generated position's
    logprobs, and the generated tokens' summed log-probability."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best ``beam_width`` beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    try:
        return beam.cum_logprob / (max(length, 1) ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # a length_penalty so far from 0 that the power leaves the floats
        return beam.cum_logprob / math.exp(math.copysign(700.0, length_penalty))


class BeamSearch:
    """The beams of a batch of prompts, advanced one engine step at a time: ``prompts()`` are
    the live beams to step (token ids; send them with ``step_params``), ``advance(outputs)``
    takes their finished one-token outputs in that order; ``results()`` once ``done``."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: set[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True, detokenize=False)
        self.live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not any(self.live)

    def prompts(self) -> list[list[int]]:
        return [beam.tokens for group in self.live for beam in group]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        position = 0
        for index, group in enumerate(self.live):
            extensions = []
            for beam, output in zip(group, outputs[position : position + len(group)]):
                top = (output.outputs[0].logprobs or [{}])[0]
                for token_id, logprob in top.items():
                    extended = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [top], beam.cum_logprob + logprob.logprob)
                    if token_id in self.eos_token_ids and not self.params.ignore_eos:
                        extended.finish_reason, extended.stop_reason = "stop", token_id
                        self.completed[index].append(extended)
                    else:
                        extensions.append(extended)
            position += len(group)
            extensions.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length in a step: the score's order
            self.live[index] = extensions[: self.params.beam_width]
            if self.live[index] and len(self.live[index][0].tokens) >= self.max_model_len:  # the context is full: no further step
                for beam in self.live[index]:
                    beam.finish_reason = "length"
                self.completed[index].extend(self.live[index])
                self.live[index] = []
        self.num_steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's best ``beam_width`` beams, completed and live, best first."""
        results = []
        for completed, live in zip(self.completed, self.live):
            for beam in live:
                beam.finish_reason = "length"
            ranked = sorted(completed + live, key=lambda b: beam_score(b, self.eos_token_ids, self.params.length_penalty), reverse=True)
            best = ranked[: self.params.beam_width]
            if decode is not None:
                for beam in best:
                    beam.text = decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(
    generate: Callable[[list[dict[str, Any]], SamplingParams], list[RequestOutput]],
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for each of ``prompts`` (token ids), one engine step of every live beam at
    a time through ``generate`` (prompts and sampling parameters in, finished outputs out). A
    beam that fills the context stops there, as if at ``max_tokens``."""
    search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
    while not search.done:
        search.advance(generate([{"prompt_token_ids": tokens} for tokens in search.prompts()], search.step_params))
    return search.results(decode)
