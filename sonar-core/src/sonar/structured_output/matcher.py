"""One request's place in its grammar."""

from __future__ import annotations

import logging

import xgrammar as xgr

logger = logging.getLogger(__name__)


class RequestGrammar:
    """Follows the tokens a request produced through its compiled grammar.

    A request that comes back after preemption gets a new ``RequestGrammar`` rolled forward
    over the tokens it had produced, so masking resumes where it stopped.

    :param compiled: the request's compiled grammar.
    :param output_token_ids: tokens already produced (a resumed request's), accepted at once.
    """

    __slots__ = ("failed", "matcher", "num_accepted")

    def __init__(self, compiled: xgr.CompiledGrammar, output_token_ids: list[int] | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.failed = False
        for token_id in output_token_ids or ():
            self.accept(token_id)

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and the grammar stops masking) if the grammar
        does not allow it, which only happens when every token was masked."""
        if self.failed or self.matcher.is_terminated():
            return False
        if not self.matcher.accept_token(token_id):
            logger.warning("token %d is not allowed by the request's grammar; the rest is unconstrained", token_id)
            self.failed = True
            return False
        self.num_accepted += 1
        return True

    @property
    def active(self) -> bool:
        """Whether the next token must be masked."""
        return not self.failed and not self.matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
