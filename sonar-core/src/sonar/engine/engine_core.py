"""The engine core: scheduler + KV-cache manager + executor, driven one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sonar.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request, RequestStatus
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import SchedulerOutput
from sonar.engine.wire import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from sonar.executor.uniproc import UniprocExecutor
from sonar.platform import Platform

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps before the engine gives up


@dataclass(slots=True)
class _InFlightStep:
    scheduled: SchedulerOutput
    handle: Any  # the executor's handle on the launched step


class EngineCore:
    def __init__(
        self,
        platform: type[Platform],
        model_config: ModelConfig,
        scheduler_config: SchedulerConfig,
        block_size: int,
        enable_prefix_caching: bool,
        kv_cache_memory_bytes: int | None,
        gpu_memory_utilization: float,
        async_scheduling: bool,
    ) -> None:
        self.model_config = model_config
        self.executor = UniprocExecutor(platform, model_config, block_size)
        num_blocks = self.executor.determine_num_blocks(kv_cache_memory_bytes, gpu_memory_utilization)
        blocks_per_seq = -(-scheduler_config.max_model_len // block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}), "
                f"fewer than max_model_len={scheduler_config.max_model_len}: raise kv_cache_memory_bytes "
                f"(or gpu_memory_utilization) or lower max_model_len"
            )
        if kv_cache_memory_bytes is None:  # no point in more than every sequence at full length
            num_blocks = min(num_blocks, blocks_per_seq * scheduler_config.max_num_seqs)
        self.cache_config = CacheConfig(block_size, num_blocks, enable_prefix_caching)
        self.executor.init_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_failed_steps = 0
        self.async_scheduling = async_scheduling
        self.num_steps_launched = 0
        self._in_flight: _InFlightStep | None = None
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, block_size)

    @classmethod
    def from_config(cls, config: EngineConfig, platform: type[Platform]) -> EngineCore:
        """Load the model and size the KV cache as ``config`` says."""
        from sonar.engine.resolve import model_config_of

        return cls(
            platform,
            model_config_of(config),
            config.scheduler_config,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_cache_memory_bytes,
            config.gpu_memory_utilization,
            config.async_scheduling,
        )

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        if isinstance(request, EngineCoreRequest):
            request = Request(
                request.request_id,
                request.prompt_token_ids,  # type: ignore[arg-type]  # a list once decoded
                request.sampling_params,
                self.model_config.eos_token_ids,
                request.max_tokens,
                arrival_time=request.arrival_time,
            )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        # a step still in flight holds only unfinished requests, unless all of them were
        # finished or aborted meanwhile; then nothing waits for it, and the next step collects it
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then collect the results of the step before it.

        With asynchronous scheduling the next step is scheduled and launched while the
        previous one still runs on the device: its host work (scheduling, building inputs)
        overlaps the device's, and so does everything the caller does with the outputs this
        returns. A step holding a request whose sampling reads its earlier tokens (penalties,
        a grammar, ...) is collected before the next one is scheduled."""
        outputs: list[EngineCoreOutput] = []
        previous, self._in_flight = self._in_flight, None  # always None without async scheduling
        if previous is not None and previous.scheduled.reads_output_tokens:
            outputs = self._collect(previous)
            previous = None
        scheduled = self.scheduler.schedule()
        if not scheduled.is_empty:
            try:
                handle = self.executor.launch(scheduled)
            except Exception as exc:
                outputs += self._abort_failed_step(scheduled, exc)
            else:
                self.num_steps_launched += 1
                self._in_flight = _InFlightStep(scheduled, handle)
        elif scheduled.finished_req_ids:  # let the workers drop finished state
            self.executor.execute_model(scheduled)
        if previous is not None:
            outputs += self._collect(previous)
        if self._in_flight is not None and not self.async_scheduling:
            outputs += self._collect(self._in_flight)
            self._in_flight = None
        return outputs

    def _collect(self, step: _InFlightStep) -> list[EngineCoreOutput]:
        """Wait for a launched step's results and advance the requests by them."""
        scheduled = step.scheduled
        try:
            result = self.executor.fetch(step.handle)
        except Exception as exc:
            return self._abort_failed_step(scheduled, exc)
        self.num_failed_steps = 0
        self.num_prompt_tokens += scheduled.num_prompt_tokens
        # looked up before the update, which forgets the requests it finishes
        requests = [self.scheduler.requests.get(req_id) for req_id in result.req_ids]
        self.scheduler.update_from_output(scheduled, result)
        outputs = []
        for req_id, request, token_id, logprobs in zip(result.req_ids, requests, result.sampled_token_ids, result.logprobs):
            if request is None:
                continue  # aborted or finished while the step ran
            if token_id is not None:
                self.num_generation_tokens += 1
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=[] if token_id is None else [token_id],
                    new_logprobs=logprobs,
                    prompt_logprobs=result.prompt_logprobs.get(req_id),
                    finish_reason=request.status.value if request.is_finished else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        return outputs

    def _abort_failed_step(self, scheduled: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step that raised aborts the requests in it (their KV blocks are freed and the
        workers drop them next step) instead of taking the engine down; several failures in a
        row mean the device itself is broken, and the error propagates."""
        self.num_failed_steps += 1
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise error
        req_ids = list(scheduled.num_scheduled_tokens)
        logger.error("a step failed; aborting its %d requests", len(req_ids), exc_info=error)
        aborted = self.scheduler.abort_requests(req_ids)
        self.kv_cache.forget_free_blocks()
        return [
            EngineCoreOutput(r.request_id, [], None, None, "abort", "engine error", max(r.num_cached_tokens, 0))
            for r in aborted
        ]

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_total_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.num_queries,
            prefix_cache_hits=kv.stats.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )
