"""The sampler: turns a batch of logits into next tokens (and logprobs), vectorized over requests.

``SamplingMetadata.build(states, vocab_size, device)`` packs one step's per-request options into
tensors; ``Sampler()(logits, metadata)`` returns a ``SamplerOutput``. Every stage is skipped
when no row of the batch uses it and runs only on the rows that do; see ``Sampler`` for the
stages and their default order, ``SamplerID`` for reordering them per request. Logprobs are
computed from the raw logits.
"""

from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata, check_token_ids
from sonar.sampler.sampler import Sampler, SamplerOutput
from sonar.sampler.sampler_ids import DEFAULT_ORDER, SamplerID

__all__ = [
    "DEFAULT_ORDER",
    "LogitsProcessor",
    "LogprobsTensors",
    "RequestSamplingState",
    "Sampler",
    "SamplerID",
    "SamplerOutput",
    "SamplingMetadata",
    "check_token_ids",
    "compute_logprobs",
]
