"""The model runner's side of structured output: one grammar matcher per constrained request,
the batch mask before sampling, and advancing the matchers after it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sonar.config import ModelConfig
    from sonar.engine.scheduler_output import SchedulerOutput
    from sonar.structured_output.bitmask import GrammarBitmask
    from sonar.structured_output.matcher import RequestGrammar

logger = logging.getLogger(__name__)


class StructuredOutputRunner:
    """Holds the matchers of the running constrained requests of one model runner.

    A request gets its matcher when the scheduler sends it as new, which includes a preempted
    request coming back: the matcher is then rebuilt from the tokens it had produced. Requests
    without a constraint cost one dict lookup per step.

    :param model_config: the runner's model (its path finds the engine's grammar compiler).
    """

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.grammars: dict[str, RequestGrammar] = {}
        self._bitmask: GrammarBitmask | None = None

    def update(self, so: SchedulerOutput) -> None:
        """Drop finished (and preempted) requests' matchers; make new requests' matchers."""
        for req_id in so.finished_req_ids:
            self.grammars.pop(req_id, None)
        for new in so.new_reqs:
            guided = new.sampling_params.guided_decoding
            if guided is None:
                continue
            from sonar.structured_output.matcher import RequestGrammar

            try:
                compiled = self._compiler().compile(guided, timeout_s=3600.0)
            except Exception as exc:  # it compiled when the request was added; never kill the step loop
                logger.error("request %s: its grammar failed to compile in the runner (%s); generating unconstrained", new.req_id, exc)
                continue
            self.grammars[new.req_id] = RequestGrammar(compiled, new.output_token_ids)

    def apply_bitmask(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Mask ``logits`` ``[len(req_ids), V]`` in place: each constrained row keeps only the
        tokens its grammar allows next. One bitmask fill and one apply for the whole batch."""
        if not self.grammars:
            return
        grammars = [self.grammars.get(req_id) for req_id in req_ids]
        if not any(grammars):
            return
        if self._bitmask is None:
            from sonar.structured_output.bitmask import GrammarBitmask

            self._bitmask = GrammarBitmask(self.model_config.vocab_size)
        self._bitmask.apply(logits, grammars)

    def accept(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the matchers of the constrained requests over their sampled tokens."""
        if not self.grammars:
            return
        for req_id, token_id in zip(req_ids, token_ids):
            grammar = self.grammars.get(req_id)
            if grammar is not None:
                grammar.accept(token_id)

    def _compiler(self) -> Any:
        from sonar.structured_output.compiler import get_grammar_compiler

        config = self.model_config
        try:
            return get_grammar_compiler(config.model)
        except ValueError:  # a runner in its own process: load the tokenizer here
            from sonar.registry import weight_formats

            tokenizer = weight_formats()[config.load_format].load_tokenizer(Path(config.model))
            return get_grammar_compiler(config.model, tokenizer, config.vocab_size, config.eos_token_ids)
