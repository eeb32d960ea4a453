"""The sampler: turns a batch of logits into next tokens (and logprobs), vectorized over requests.

``SamplingMetadata.build(states, vocab_size, device)`` packs one step's per-request options into
tensors; ``Sampler()(logits, metadata)`` returns a ``SamplerOutput``. Every stage is skipped
when no row of the batch uses it and runs only on the rows that do; see ``Sampler`` for the
stages and their default order, ``SamplerStage`` for adding one from a plugin, ``SamplerID``
for reordering them per request. Logprobs are computed from the raw logits.
"""

from sonar.sampler.logits_processor import LogitsProcessor
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata, check_token_ids
from sonar.sampler.sampler import Sampler, SamplerOutput
from sonar.sampler.sampler_ids import SamplerID
from sonar.sampler.stage import SamplerStage, StageContext, StageParam

__all__ = [
    "LogitsProcessor",
    "LogprobsTensors",
    "RequestSamplingState",
    "Sampler",
    "SamplerID",
    "SamplerOutput",
    "SamplerStage",
    "SamplingMetadata",
    "StageContext",
    "StageParam",
    "check_token_ids",
    "compute_logprobs",
]
