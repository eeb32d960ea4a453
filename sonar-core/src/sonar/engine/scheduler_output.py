"""What the scheduler tells the workers each step: plain data only, so it can cross processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sonar.kv_transfer.interface import KVConnectorOutput
from sonar.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen (or see again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)


@dataclass(slots=True)
class CachedRequestData:
    """A request the workers already hold: its new blocks and progress."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # pipeline parallelism: output tokens sampled since the workers last saw it (the stages
    # that do not sample append them; empty without pipeline parallelism)
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # drop their worker state
    preempted_req_ids: set[str] = field(default_factory=set)  # subset of finished: they come back
    num_prompt_tokens: int = 0  # of the scheduled tokens, those that are prompt tokens
    reads_output_tokens: bool = False  # a scheduled request samples from its earlier tokens' values
    sampling_req_ids: list[str] = field(default_factory=list)  # scheduled requests that sample a token
    # structured output: the constrained sampling requests and their allowed-token bitmask
    # ([len(grammar_req_ids), ceil(V / 32)] int32, host), filled by the engine core
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # speculative decoding: the draft tokens each verifying request's scheduled tokens end with,
    # and whether the proposer drafts after this step (confidence-scheduled verification skips
    # drafting when the next step would verify none)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # rows scheduled past a request's drafts for further verify passes in the same step
    # (``verify_passes``): the worker drafts them from the tokens each pass keeps
    spec_pass_rows: dict[str, int] = field(default_factory=dict)
    propose_drafts: bool = True
    draft_limit: int | None = None  # where it drafts: for at most this many requests (a probe's few; None: all)
    # KV connector: the step's loads and saves for the worker half (its KVConnectorMetadata)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class RequestLogprobs:
    """Per position: column 0 is the chosen (or target) token, then the top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[int | None]  # None: a prefill chunk that produced no token yet
    logprobs: list[RequestLogprobs | None]
    prompt_logprobs: dict[str, RequestLogprobs] = field(default_factory=dict)  # this step's chunk
    # speculative decoding: every token a verifying request emitted (its sampled_token_ids
    # entry is the first of them; its logprobs have one position per token), the drafts
    # proposed for each request's next step, and the survival estimates of those drafts
    # (plain floats, one per draft, non-increasing) where the proposer gives them
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # a step of several verify passes: per request, each pass's drafts and kept drafts, in order
    verified_passes: dict[str, list[list[int]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_confidence: dict[str, list[float]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # how long proposing them took (0: no proposal after this step)
    draft_rows: int = 0  # how many requests that proposal drafted for
    kv_connector_output: KVConnectorOutput | None = None  # transfers the connector finished
