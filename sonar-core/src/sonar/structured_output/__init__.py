"""Structured output: constrain what a request may generate to a JSON schema, any JSON object,
a regex, an EBNF grammar or a choice among strings, with xgrammar.

- ``params.GuidedDecodingParams``: what a request asks for (``SamplingParams.guided_decoding``).
- ``compiler.GrammarCompiler``: compiles constraints in a thread pool under a time limit,
  behind a cache bounded in entries and bytes; ``get_grammar_compiler`` gives a model's one.
- ``matcher.RequestGrammar``: one request's matcher, advanced with each accepted token.
- ``manager.StructuredOutputManager``: the engine core's matchers; each step's bitmask of the
  constrained requests that sample, sent to the workers with the scheduler's output.
- ``bitmask``: fills a batch's bitmask in one call (``GrammarBitmask``); the worker applies it
  to the logits before sampling (``apply_grammar_bitmask``).

Only ``params`` is imported here: xgrammar loads when a request first asks for a constraint.
"""

from sonar.structured_output.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
