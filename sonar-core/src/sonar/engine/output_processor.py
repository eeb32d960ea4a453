"""Turns engine-core token outputs into RequestOutputs: detokenization, stop strings,
logprobs with decoded tokens, and n > 1 fan-in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sonar.engine.detokenizer import IncrementalDetokenizer
from sonar.engine.engine_core import EngineCoreOutput
from sonar.engine.request_stats import RequestStats
from sonar.engine.scheduler_output import RequestLogprobs
from sonar.outputs import CompletionOutput, Logprob, RequestOutput
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.outputs import append_until_stop


@dataclass(slots=True, eq=False)
class ChildState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # output_kind "delta": how much of the above earlier outputs carried
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False


@dataclass(slots=True, eq=False)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    num_sent_prompt_logprobs: int = 0  # output_kind "delta": prompt positions earlier outputs carried
    arrival_time: float = 0.0  # wall-clock times (time.time()) for RequestOutput.metrics
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_new_tokens: int = 0  # tokens the outputs being processed added, over every child

    def metrics(self) -> dict[str, float]:
        """vLLM's request timings: arrival, first and last token, and the first token's latency."""
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None and self.last_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
            metrics["last_token_time"] = self.last_token_time
            metrics["first_token_latency"] = self.first_token_time - self.arrival_time
        return metrics

    @property
    def finished(self) -> bool:
        for child in self.children.values():  # a loop, not all(genexpr): it runs per request per step
            if child.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Follows every request from ``add`` to its finish; with ``stats``, counts their tokens,
    latencies and finishes there."""

    def __init__(self, tokenizer: Any, stats: RequestStats | None = None) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, child_ids: list[str], child_params: list[SamplingParams]) -> None:
        children = {}
        for index, (child_id, cparams) in enumerate(zip(child_ids, child_params)):
            tokenizer = self.tokenizer if cparams.detokenize else None
            child = ChildState(index, IncrementalDetokenizer(tokenizer, prompt_token_ids, cparams))
            if cparams.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children[child_id] = child
            self.child_to_parent[child_id] = request_id
        parent = ParentState(request_id, prompt, prompt_token_ids, params, children, arrival_time=time.time())
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _logprob_dicts(self, lp: RequestLogprobs) -> list[dict[int, Logprob]]:
        result = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            entry: dict[int, Logprob] = {}
            for column, (token_id, value) in enumerate(zip(ids, values)):
                if token_id in entry:
                    continue
                entry[token_id] = Logprob(value, rank if column == 0 else column, self._decode(token_id))
            result.append(entry)
        return result

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the updated RequestOutputs and (child_id, stop_string) pairs the core must stop."""
        touched: dict[str, ParentState] = {}
        to_stop: list[tuple[str, str]] = []
        now = time.time()
        for out in outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[out.req_id]
            if child.finish_reason is not None:
                continue
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            if out.prompt_logprobs is not None and parent.prompt_logprobs is not None and child.index == 0:
                parent.prompt_logprobs.extend(self._logprob_dicts(out.prompt_logprobs))
            if out.new_token_ids:
                new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
                if len(new_token_ids) > 1 and child.detokenizer.stop_strings:  # a verify step's tokens
                    new_token_ids, new_logprobs, stop = append_until_stop(child.detokenizer, new_token_ids, new_logprobs)
                else:
                    stop = child.detokenizer.append(new_token_ids)
                child.token_ids.extend(new_token_ids)
                parent.num_new_tokens += len(new_token_ids)
                if child.logprobs is not None and new_logprobs is not None:
                    entries = self._logprob_dicts(new_logprobs)
                    child.logprobs.extend(entries)
                    child.cumulative_logprob += sum(new_logprobs.logprobs[i][0] for i in range(len(entries)))
                # a stop string ends the request unless the core ended it with the same token
                # (as one token at a time would: a stop string completed by the last token
                # max_tokens allows finishes by length); one cut out of a verify step's tokens
                # came first, whatever ended the step's last token
                if stop is not None and (out.finish_reason is None or len(new_token_ids) < len(out.new_token_ids)):
                    child.finish_reason, child.stop_reason = "stop", stop
                    if out.finish_reason is None:
                        to_stop.append((out.req_id, stop))
            if out.finish_reason is not None and child.finish_reason is None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            touched[parent_id] = parent
        results = []
        stats = self.stats
        for parent in touched.values():
            if parent.num_new_tokens:
                if stats is not None:
                    stats.observe_tokens(parent.arrival_time, parent.last_token_time, now, parent.num_new_tokens)
                if parent.first_token_time is None:
                    parent.first_token_time = now
                parent.last_token_time = now
                parent.num_new_tokens = 0
            finished = parent.finished
            if finished or parent.params.output_kind != "final_only":
                results.append(self._request_output(parent, finished))
            if finished:
                self._forget(parent, now)
        return results, to_stop

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        output = self._request_output(parent)
        self._forget(parent, time.time())
        return output

    def _forget(self, parent: ParentState, now: float) -> None:
        """Drop a finished request (counted in ``stats`` first)."""
        if self.stats is not None:
            first = next(iter(parent.children.values()))
            num_generated = sum(len(child.token_ids) for child in parent.children.values())
            self.stats.observe_finished(first.finish_reason or "abort", len(parent.prompt_token_ids), num_generated, now - parent.arrival_time)
        self.parents.pop(parent.request_id, None)
        for child_id in parent.children:
            self.child_to_parent.pop(child_id, None)

    @staticmethod
    def _visible_text(child: ChildState) -> str:
        """The text so far, less a tail that could still turn out to begin a stop string
        (streamed text is never taken back)."""
        detokenizer = child.detokenizer
        text = detokenizer.output_text
        if child.finish_reason is None and detokenizer.max_stop_len > 1:
            return text[: max(0, len(text) - detokenizer.max_stop_len + 1)]
        return text

    def _request_output(self, parent: ParentState, finished: bool | None = None) -> RequestOutput:
        if finished is None:
            finished = parent.finished
        if parent.params.output_kind == "delta":
            return self._delta_output(parent, finished)
        completions = [
            CompletionOutput(
                index=child.index,
                text=self._visible_text(child),
                token_ids=list(child.token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            )
            for child in parent.children.values()
        ]
        output = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
        )
        if finished:  # timings on the finished output only: nothing more per step
            output.metrics = parent.metrics()
        return output

    def _delta_output(self, parent: ParentState, finished: bool) -> RequestOutput:
        """Only what is new since the request's last output: each child with new tokens, text
        or a finish, holding just those, and prompt logprobs not carried before."""
        completions = []
        for child in parent.children.values():
            text = self._visible_text(child)
            has_finish = child.finish_reason is not None and not child.finish_sent
            if len(child.token_ids) == child.num_sent_tokens and len(text) == child.num_sent_chars and not has_finish:
                continue
            start = child.num_sent_tokens
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text[child.num_sent_chars :],
                    token_ids=child.token_ids[start:],
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=child.logprobs[start:] if child.logprobs is not None else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
            child.num_sent_tokens, child.num_sent_chars, child.finish_sent = len(child.token_ids), len(text), child.finish_reason is not None
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and len(parent.prompt_logprobs) > parent.num_sent_prompt_logprobs:
            prompt_logprobs = parent.prompt_logprobs[parent.num_sent_prompt_logprobs :]
            parent.num_sent_prompt_logprobs = len(parent.prompt_logprobs)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics() if finished else {},
            kv_transfer_params=parent.kv_transfer_params,
        )
