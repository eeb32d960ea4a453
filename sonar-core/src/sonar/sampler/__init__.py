"""The sampler: turns a batch of logits into next tokens (and logprobs), vectorized over requests.

``SamplingMetadata.build(states, vocab_size, device)`` packs one step's per-request options into
tensors; ``Sampler()(logits, metadata)`` returns a ``SamplerOutput``. Stages run in this order,
each skipped when no row of the batch needs it: min_tokens masking, logit_bias, penalties
(repetition, presence, frequency), registered logits processors, then greedy argmax or
temperature → top-k → top-p → min-p → sampling. Logprobs are computed from the raw logits.
"""

from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata, check_token_ids
from sonar.sampler.sampler import Sampler, SamplerOutput

__all__ = [
    "LogitsProcessor",
    "LogprobsTensors",
    "RequestSamplingState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "check_token_ids",
    "compute_logprobs",
]
