"""The interface of a logits processor registered through ``sonar_register_logits_processors``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState


class LogitsProcessor:
    """A batch-level transformation of logits, applied only to the rows of requests naming it.

    A plugin registers a factory under a name (``register(name, factory)``); a request opts in
    with ``SamplingParams(logits_processors=[name])``. The sampler builds one instance per name
    (``factory()``) and keeps it for the engine's lifetime, so an instance must hold no
    per-request state of its own beyond what it can key by request (read it from ``states``).

    It runs after min_tokens masking, logit_bias and penalties, before temperature, top-k,
    top-p and min-p, and before the greedy argmax. Logprobs are unaffected (they come from the
    raw model logits). A batch in which no request names a processor never calls it.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[int],
        states: list["RequestSamplingState"],
    ) -> torch.Tensor:
        """Return the processed logits of the selected rows.

        :param logits: ``[R, V]`` float32, the logits of the R requests that named this
            processor (a copy: modifying it in place is allowed).
        :param rows: the R batch indices these rows came from, in order.
        :param states: the R requests' sampling states (params, prompt and output token ids),
            aligned with ``rows``.
        :returns: ``[R, V]`` logits to continue sampling with (may be ``logits`` itself).
        """
        raise NotImplementedError
