"""What generation returns to users."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token plus the top-k alternatives)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # on the finished output: arrival_time, first_token_time, last_token_time (time.time()), first_token_latency
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # what the engine's KV connector hands back (a prefill's: where its KV is)

    def add(self, later: RequestOutput) -> None:
        """Fold a later output of the same request (output_kind "delta") into this one: texts,
        tokens and logprobs appended per completion, finish and counts taken from ``later``."""
        by_index = {completion.index: completion for completion in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob, old.finish_reason, old.stop_reason = new.cumulative_logprob, new.finish_reason, new.stop_reason
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        self.outputs.sort(key=lambda completion: completion.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        self.kv_transfer_params = later.kv_transfer_params
