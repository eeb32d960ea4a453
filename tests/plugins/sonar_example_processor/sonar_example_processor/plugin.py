"""Registers ``no_immediate_repeat``: a request naming it never samples its previous token again
right away (``SamplingParams(logits_processors=["no_immediate_repeat"])``)."""

from __future__ import annotations

from typing import Callable

import torch

from sonar.hookspecs import hookimpl
from sonar.sampler import LogitsProcessor, RequestSamplingState


class NoImmediateRepeat(LogitsProcessor):
    """Sets the logit of each row's last context token to -inf, vectorized over the rows."""

    def __call__(self, logits: torch.Tensor, rows: list[int], states: list[RequestSamplingState]) -> torch.Tensor:
        last = [(s.output_token_ids or s.prompt_token_ids)[-1] for s in states]
        index = torch.arange(len(states), device=logits.device)
        logits[index, torch.tensor(last, device=logits.device)] = float("-inf")
        return logits


@hookimpl
def sonar_register_logits_processors(register: Callable[..., None]) -> None:
    register("no_immediate_repeat", NoImmediateRepeat)
