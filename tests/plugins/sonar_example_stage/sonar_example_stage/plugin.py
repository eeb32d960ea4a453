"""Registers ``example_boost``: a request sending ``extra_args={"example.boost_token": 42,
"example.boost": 5.0}`` has 5.0 added to the logit of token 42 at every step.

The stage runs between top-nσ (rank 500) and top-k/top-p (rank 600) by default, and on greedy
rows too (like a logit bias); ``sampler_priority`` can move it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from sonar.hookspecs import hookimpl
from sonar.sampler import RequestSamplingState, SamplerStage, StageContext, StageParam
from sonar.sampling_params import SamplingParams


class ExampleBoost(SamplerStage):
    """Adds ``example.boost`` to the logit of ``example.boost_token``, vectorized over the rows."""

    name = "example_boost"
    rank = 550
    covers_greedy = True
    params: ClassVar[dict[str, StageParam]] = {
        "example.boost_token": StageParam(int, check=lambda v: v >= 0, requirement="must be a token id >= 0"),
        "example.boost": StageParam(float, default=10.0, doc="added to the token's logit"),
    }

    def uses(self, params: SamplingParams) -> bool:
        return params.extra_args is not None and "example.boost_token" in params.extra_args

    def validate(self, params: SamplingParams) -> None:
        if params.extra_args is not None and "example.boost" in params.extra_args and not self.uses(params):
            raise ValueError('extra_args["example.boost"] needs extra_args["example.boost_token"]')

    def build(
        self, states: list[RequestSamplingState], rows: list[int], vocab_size: int, device: torch.device
    ) -> Any | None:
        picked = [(row, self.param(states[row].params, "example.boost_token")) for row in rows]
        picked = [(row, token) for row, token in picked if token < vocab_size]
        if not picked:
            return None
        boosts = [float(self.param(states[row].params, "example.boost")) for row, _ in picked]
        return (
            torch.tensor([row for row, _ in picked], device=device),
            torch.tensor([token for _, token in picked], device=device),
            torch.tensor(boosts, dtype=torch.float32, device=device),
        )

    def apply(self, logits: torch.Tensor, tensors: Any, context: StageContext) -> torch.Tensor:
        rows, tokens, boosts = tensors
        logits[rows, tokens] += boosts
        return logits


@hookimpl
def sonar_register_sampler_stages(register: Callable[..., None]) -> None:
    register(ExampleBoost())
