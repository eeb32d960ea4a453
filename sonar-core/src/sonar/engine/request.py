"""A request's lifecycle inside the engine core."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field

from sonar.lora.request import LoRARequest
from sonar.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holding its blocks while a connector loads them
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # a string set: this is on every step's hot path


_FINISHED_VALUES = frozenset({"stop", "length", "abort"})


def token_at(prompt_token_ids: list[int], output_token_ids: list[int], index: int) -> int:
    """The token at position ``index`` of a sequence: its prompt, then its output."""
    n = len(prompt_token_ids)
    return prompt_token_ids[index] if index < n else output_token_ids[index - n]


def token_ids_in(prompt_token_ids: list[int], output_token_ids: list[int], start: int, end: int) -> list[int]:
    """The tokens at positions ``start`` to ``end - 1`` of a sequence: its prompt, then its output."""
    n = len(prompt_token_ids)
    if end <= n:
        return prompt_token_ids[start:end]
    if start >= n:
        return output_token_ids[start - n : end - n]
    return prompt_token_ids[start:] + output_token_ids[: end - n]


def lora_hash_seed(lora_int_id: int) -> bytes | None:
    """What a request of adapter ``lora_int_id`` chains its block hashes from (None: the base
    model, whose hashes are unchanged)."""
    if not lora_int_id:
        return None
    return hashlib.blake2b(f"sonar-lora:{lora_int_id}".encode(), digest_size=16).digest()


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int  # resolved against the context
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # with the priority policy: lower runs first
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when scheduled
    num_pending_tokens: int = 0  # tokens scheduled to be sampled whose values are not known yet
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of full blocks
    first_token_time: float | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step
    spec_confidence: list[float] | None = None  # their survival estimates, where the proposer gives them
    reads_output_tokens: bool = field(init=False)  # its sampling needs earlier tokens' values
    kv_transfer_params: dict | None = None  # what its KV connector hands back when it finishes
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    block_hash_seed: bytes | None = field(init=False)  # its first block's hash parent: adapters never share KV
    stop_token_set: frozenset[int] = field(init=False, repr=False)  # its stop token ids, looked up per token

    def __post_init__(self) -> None:
        self.reads_output_tokens = self.sampling_params.reads_output_tokens
        self.block_hash_seed = lora_hash_seed(self.lora_int_id)
        self.stop_token_set = frozenset(self.sampling_params.stop_token_ids or ())

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_range(self, start: int, end: int) -> list[int]:
        return token_ids_in(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def check_stop(self) -> bool:
        """Stop on eos / stop token ids / length after a new token; sets status."""
        params = self.sampling_params
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if self.num_output_tokens < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in self.stop_token_set:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        return False
