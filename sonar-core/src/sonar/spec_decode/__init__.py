"""Speculative decoding: the proposer interface and its data types.

A proposer guesses the next few tokens of each running request cheaply (an n-gram lookup in
the request's own tokens, a small draft model, heads on the target's hidden states); the
target model then scores all of them in one step and a rejection sampler keeps the longest
prefix it agrees with, plus one token of its own. Proposers are registered through
``sonar_register_speculative_proposers`` under a method name and selected with
``speculative_config={"method": NAME, ...}``.
"""

from sonar.spec_decode.interface import DraftTokens, Proposer, ProposerInputs, SpeculativeConfig

__all__ = ["DraftTokens", "Proposer", "ProposerInputs", "SpeculativeConfig"]
