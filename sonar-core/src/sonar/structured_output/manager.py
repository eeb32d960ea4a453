"""The engine core's side of structured output: one grammar matcher per constrained request,
advanced over the tokens the request accepts, and each step's token bitmask for the requests
that sample in it, sent to the workers with the scheduler's output."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sonar.config import ModelConfig
    from sonar.engine.request import Request
    from sonar.structured_output.bitmask import GrammarBitmask
    from sonar.structured_output.matcher import RequestGrammar

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """Owns the grammar matchers of one engine core.

    A matcher follows the tokens its request accepted, so it survives preemption unchanged
    (the request's tokens do not change when its KV blocks are recomputed). Requests without
    a constraint cost nothing.

    :param model_config: the engine's model (its path finds the grammar compiler; its
        tokenizer is loaded here where the compiler was not made in this process).
    """

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.grammars: dict[str, RequestGrammar] = {}
        self._bitmask: GrammarBitmask | None = None

    def add_request(self, request: Request) -> None:
        """Make the matcher of a constrained request as it enters the engine core."""
        guided = request.sampling_params.guided_decoding
        if guided is None:
            return
        from sonar.structured_output.matcher import RequestGrammar

        try:
            compiled = self._compiler().compile(guided, timeout_s=3600.0)
        except Exception as exc:  # it compiled at admission; never kill the step loop
            logger.error("request %s: its grammar failed to compile in the engine core (%s); generating unconstrained", request.request_id, exc)
            return
        self.grammars[request.request_id] = RequestGrammar(compiled, request.output_token_ids)

    def remove(self, request_ids: set[str] | list[str]) -> None:
        for request_id in request_ids:
            self.grammars.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance a request's matcher over the token it just accepted."""
        grammar = self.grammars.get(request_id)
        if grammar is not None:
            grammar.accept(token_id)

    def grammar_bitmask(self, sampling_req_ids: list[str]) -> tuple[list[str], torch.Tensor] | None:
        """The allowed-token bitmask of the constrained requests among ``sampling_req_ids``
        (those that sample this step): their ids and ``[len(ids), ceil(V / 32)]`` int32 rows,
        in that order; None when none of them is constrained."""
        if not self.grammars:
            return None
        grammars = [self.grammars.get(req_id) for req_id in sampling_req_ids]
        if not any(grammars):
            return None
        if self._bitmask is None:
            from sonar.structured_output.bitmask import GrammarBitmask

            self._bitmask = GrammarBitmask(self.model_config.vocab_size)
        rows, bitmask = self._bitmask.fill(grammars)
        if not rows:
            return None
        return [sampling_req_ids[i] for i in rows], bitmask

    def _compiler(self) -> Any:
        from sonar.structured_output.compiler import get_grammar_compiler

        config = self.model_config
        try:
            return get_grammar_compiler(config.model)
        except ValueError:  # an engine core in its own process: load the tokenizer here
            from sonar.registry import weight_formats

            tokenizer = weight_formats()[config.load_format].load_tokenizer(Path(config.model))
            return get_grammar_compiler(config.model, tokenizer, config.vocab_size, config.eos_token_ids)
