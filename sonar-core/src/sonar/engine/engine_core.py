"""The engine core: scheduler + KV-cache manager + executor, driven one step at a time."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from sonar import registry
from sonar.config import CacheConfig, EngineConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request, RequestStatus
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import SchedulerOutput
from sonar.engine.step_cost import StepCostModel
from sonar.engine.wire import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from sonar.executor.base import Executor, WorkerDiedError
from sonar.kv_transfer.factory import build_kv_connector
from sonar.kv_transfer.interface import KVConnector, KVConnectorRole
from sonar.lora.registry import LoRARegistry
from sonar.lora.request import LoRARequest
from sonar.structured_output.manager import StructuredOutputManager
from sonar.worker.phase_timer import PhaseTimer
from sonar.platform import Platform
from sonar.registry import load_registered
from sonar.spec_decode.stats import spec_decode_stats_fields, truncated_logprobs
from sonar.spec_decode.verification import ConfidenceVerification

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps before the engine gives up
KV_POLL_S = 0.005  # how long a step with nothing but KV transfers to wait for waits
# a gap between two steps longer than both of these is the caller idling, not host work
IDLE_GAP_S = 0.05
IDLE_GAP_RATIO = 2.0  # times the step's own time


@dataclass(slots=True)
class _InFlightStep:
    scheduled: SchedulerOutput
    handle: Any  # the executor's handle on the launched step


class EngineCore:
    """One engine replica: the scheduler, the KV-cache manager and the executor, built from the
    engine configuration and the plugins it names (scheduling policy, KV-cache manager,
    executor), driven one ``step()`` at a time."""

    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        from sonar.engine.resolve import model_config_of

        self.config = config
        self.model_config = model_config_of(config)
        executor_cls = load_registered("executor", config.executor, registry.executors())
        self.executor: Executor = executor_cls(config, self.model_config, platform)
        self.cache_config = self._size_kv_cache(config)
        self.executor.init_kv_cache(self.cache_config.num_blocks)
        manager_cls = load_registered("KV-cache manager", config.kv_cache_manager, registry.kv_cache_managers())
        self.kv_cache: KVCacheManager = manager_cls(
            self.cache_config.num_blocks, config.block_size, config.enable_prefix_caching, specs=self.executor.kv_cache_specs()
        )
        policy_cls = load_registered("scheduling policy", config.scheduling_policy, registry.scheduler_policies())
        self.kv_connector: KVConnector | None = None
        if config.kv_transfer_config is not None:
            self.kv_connector = build_kv_connector(config.kv_transfer_config, KVConnectorRole.SCHEDULER, self.executor.kv_cache_layout())
            self.kv_connector.set_handshake_metadata(self.executor.kv_connector_handshake())
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache, policy_cls(), self.kv_connector)
        self.loras = LoRARegistry(
            config.enable_lora, self.executor.add_lora, self.executor.remove_lora, self.scheduler.num_requests_of_lora.__getitem__
        )
        self.step_costs: StepCostModel | None = None  # the profiled step-time curve, where a policy needs it
        self._init_verification(config)
        self.structured_output = StructuredOutputManager(self.model_config)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_failed_steps = 0
        self.async_scheduling = config.async_scheduling
        self.num_steps_launched = 0
        self._in_flight: _InFlightStep | None = None
        # pipeline parallelism: up to pipeline_parallel_size steps in flight, collected in order
        self.pipeline_depth = config.pipeline_parallel_size
        self._batch_queue: deque[_InFlightStep] | None = deque() if self.pipeline_depth > 1 else None
        self._timer = PhaseTimer()
        # the host's time per step for the verification policy: seconds spent waiting in the
        # executor's fetch (all told), and the iteration being timed (started, that wait then,
        # its requests, whether it verifies drafts)
        self._fetch_seconds = 0.0
        self._timed_iteration: tuple[float, float, int, bool] | None = None
        self._step_returned = 0.0
        logger.info("KV cache: %d blocks of %d tokens", self.cache_config.num_blocks, config.block_size)

    def _init_verification(self, config: EngineConfig) -> None:
        """Confidence-scheduled verification: profile the target's step time on the device
        (the KV cache exists, no request has run) and give the scheduler its policy."""
        spec = config.speculative_config
        if spec is None or spec.verification != "confidence":
            return
        started = time.perf_counter()
        try:
            self.step_costs = self.executor.profile_step_costs(config.max_num_batched_tokens)
        except NotImplementedError as exc:
            logger.warning("%s: every draft is verified (fixed verification) instead of scheduling by confidence", exc)
            return
        logger.info(
            "profiled the step cost of %d token counts in %.1f s (tokens, ms): %s",
            len(self.step_costs.num_tokens), time.perf_counter() - started, self.step_costs.as_rows(),
        )
        self.scheduler.verification = ConfidenceVerification(
            self.step_costs, spec.num_speculative_tokens, config.max_num_batched_tokens, self.scheduler.spec_stats
        )

    @classmethod
    def from_config(cls, config: EngineConfig, platform: type[Platform]) -> EngineCore:
        """Load the model and size the KV cache as ``config`` says."""
        return cls(config, platform)

    def _size_kv_cache(self, config: EngineConfig) -> CacheConfig:
        """As many blocks as the executor's memory budget holds (after its profile of the
        largest step), and no more than every sequence at full length needs."""
        num_blocks = self.executor.available_kv_blocks()
        blocks_per_seq = -(-config.max_model_len // config.block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens ({num_blocks} blocks of {config.block_size}), "
                f"fewer than max_model_len={config.max_model_len}: raise kv_cache_memory_bytes "
                f"(or gpu_memory_utilization), lower max_model_len, or lower max_num_seqs / max_num_batched_tokens "
                f"(the largest step's own memory comes first)"
            )
        if config.kv_cache_memory_bytes is None:  # no point in more than every sequence at full length
            num_blocks = min(num_blocks, blocks_per_seq * config.max_num_seqs)
        return CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching)

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        """Queue a request.

        :raises LoRAError: it names an adapter that is not served (frontends add it first)
            or is being removed; the request is not queued.
        """
        self.loras.check_request(request.lora_request)
        if isinstance(request, EngineCoreRequest):
            request = Request(
                request.request_id,
                request.prompt_token_ids,  # type: ignore[arg-type]  # a list once decoded
                request.sampling_params,
                self.model_config.eos_token_ids,
                request.max_tokens,
                arrival_time=request.arrival_time,
                priority=request.priority,
                lora_request=request.lora_request,
            )
        self.structured_output.add_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        if self.loras.removing:
            self.loras.finish_removals()

    # -- LoRA adapters -------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Serve an adapter (read and checked now, by the workers); False where this very
        adapter is served already.

        :raises LoRAError: it cannot be served (the message says why).
        """
        return self.loras.add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter: at once where no request uses it, else once its running
        and waiting requests have finished (it takes no new ones meanwhile). False where it
        is not served."""
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters served, by id."""
        return self.loras.listed()

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        # a step still in flight holds only unfinished requests, unless all of them were
        # finished or aborted meanwhile; then nothing waits for it, and the next step collects it;
        # blocks a KV connector still moves keep the engine stepping until it reports them done
        return self.scheduler.num_unfinished > 0 or self.scheduler.has_pending_transfers or bool(self._batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch the next step, then collect the results of the step before it.

        With asynchronous scheduling the next step is scheduled and launched while the
        previous one still runs on the device: its host work (scheduling, building inputs)
        overlaps the device's, and so does everything the caller does with the outputs this
        returns. A step holding a request whose sampling reads its earlier tokens (penalties,
        a grammar, ...) is collected before the next one is scheduled, and so is one whose
        successor may verify drafts (speculative decoding: the drafts come from its tokens):
        one that verified some or ran several verify passes, or any while few enough requests
        run to take drafts.

        With pipeline parallelism, see ``_step_pipelined``."""
        if self._batch_queue is not None:
            return self._step_pipelined()
        started, fetched = time.perf_counter(), self._fetch_seconds
        if self._timed_iteration is not None:
            self._observe_host_time(started)
        outputs: list[EngineCoreOutput] = []
        previous, self._in_flight = self._in_flight, None  # always None without async scheduling
        if previous is not None and (previous.scheduled.reads_output_tokens or self._drafts_may_follow(previous)):
            outputs = self._collect(previous)
            previous = None
        scheduled = self.scheduler.schedule()
        self._attach_grammar_bitmask(scheduled)
        if not scheduled.is_empty:
            try:
                handle = self.executor.launch(scheduled)
            except Exception as exc:
                outputs += self._abort_failed_step(scheduled, exc)
            else:
                self.num_steps_launched += 1
                self._in_flight = _InFlightStep(scheduled, handle)
                if self.scheduler.verification is not None and self.async_scheduling:
                    self._time_iteration(started, fetched, scheduled)
        elif scheduled.finished_req_ids or self._connector_busy(scheduled):  # workers drop finished state, connectors poll
            result = self.executor.execute_model(scheduled)
            self.scheduler.update_finished_transfers(result.kv_connector_output)
            if previous is None and result.kv_connector_output is None and self.scheduler.has_pending_transfers:
                time.sleep(KV_POLL_S)  # only transfers in progress: do not spin
        if previous is not None:
            outputs += self._collect(previous)
        if self._in_flight is not None and not self.async_scheduling:
            outputs += self._collect(self._in_flight)
            self._in_flight = None
        if self.loras.removing:  # adapters whose last request just ended
            self.loras.finish_removals()
        self._step_returned = time.perf_counter()
        return outputs

    def _time_iteration(self, started: float, fetched: float, scheduled: SchedulerOutput) -> None:
        """Time this iteration's host work for the verification policy, where its step is a
        decode step that verifies drafts or one that neither verifies nor drafts (a prefill's
        host work, or a step that drafts without verifying, is neither kind)."""
        verifying = bool(scheduled.scheduled_spec_decode_tokens)
        if scheduled.num_prompt_tokens or (scheduled.propose_drafts and not verifying):
            return
        self._timed_iteration = (started, fetched, len(scheduled.num_scheduled_tokens), verifying)

    def _observe_host_time(self, now: float) -> None:
        """The last iteration's host time (from its start to this one's, less its waits for
        results) to the verification policy."""
        started, fetched, num_requests, verifying = self._timed_iteration
        self._timed_iteration = None
        if now - self._step_returned > max(IDLE_GAP_S, IDLE_GAP_RATIO * (self._step_returned - started)):
            return  # the caller let the engine idle between the two: not the step's host work
        self.scheduler.verification.observe_host(num_requests, (now - started) - (self._fetch_seconds - fetched), verifying)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: launch a step while fewer than ``pipeline_parallel_size`` are in
        flight, so every stage has a micro-batch to work on (the scheduler leaves out the
        requests that already have a step in flight); collect the oldest step once the queue is
        full or nothing new could be scheduled. Results are consumed in launch order."""
        queue = self._batch_queue
        outputs: list[EngineCoreOutput] = []
        launched = False
        if len(queue) < self.pipeline_depth:
            scheduled = self.scheduler.schedule()
            self._attach_grammar_bitmask(scheduled)
            if not scheduled.is_empty or scheduled.finished_req_ids:  # workers drop finished state in order too
                try:
                    handle = self.executor.launch(scheduled)
                except Exception as exc:
                    outputs += self._abort_failed_step(scheduled, exc)
                else:
                    launched = not scheduled.is_empty
                    self.num_steps_launched += launched
                    queue.append(_InFlightStep(scheduled, handle))
        if queue and (len(queue) >= self.pipeline_depth or not launched):
            outputs += self._collect(queue.popleft())
        if self.loras.removing:
            self.loras.finish_removals()
        return outputs

    def _connector_busy(self, scheduled: SchedulerOutput) -> bool:
        """Whether a step that schedules no tokens still has KV-connector work to run."""
        if self.kv_connector is None:
            return False
        metadata = scheduled.kv_connector_metadata
        return self.scheduler.has_pending_transfers or (metadata is not None and metadata.has_work)

    def _drafts_may_follow(self, previous: _InFlightStep) -> bool:
        """Whether the step in flight must be collected before the next is scheduled: it
        verifies drafts, or runs further verify passes (how many of their rows it keeps is
        known only from its results), or the next step may draft from its tokens."""
        limit = self.scheduler.config.spec_max_batch_size
        if not limit:
            return False
        scheduled = previous.scheduled
        if scheduled.scheduled_spec_decode_tokens or scheduled.spec_pass_rows:
            return True
        return scheduled.propose_drafts and len(self.scheduler.running) <= limit

    def _attach_grammar_bitmask(self, scheduled: SchedulerOutput) -> None:
        """Drop the matchers of finished requests; give the step the bitmask of the
        constrained requests that sample in it."""
        manager = self.structured_output
        if not manager.grammars:
            return
        manager.remove(scheduled.finished_req_ids - scheduled.preempted_req_ids)
        masked = manager.grammar_bitmask(scheduled.sampling_req_ids)
        if masked is not None:
            scheduled.grammar_req_ids, scheduled.grammar_bitmask = masked

    def _collect(self, step: _InFlightStep) -> list[EngineCoreOutput]:
        """Wait for a launched step's results and advance the requests by them."""
        scheduled = step.scheduled
        waited = time.perf_counter()
        try:
            result = self.executor.fetch(step.handle)
        except Exception as exc:
            return self._abort_failed_step(scheduled, exc)
        finally:
            self._fetch_seconds += time.perf_counter() - waited
        self.num_failed_steps = 0
        self.num_prompt_tokens += scheduled.num_prompt_tokens
        # looked up before the update, which forgets the requests it finishes
        requests = [self.scheduler.requests.get(req_id) for req_id in result.req_ids]
        if scheduled.grammar_req_ids:  # the matchers follow the tokens their requests accept
            for req_id, request, token_id in zip(result.req_ids, requests, result.sampled_token_ids):
                if token_id is not None and request is not None and not request.is_finished:
                    self.structured_output.accept(req_id, token_id)
        verified = result.verified_token_ids
        num_before = {r.request_id: r.num_output_tokens for r in requests if r is not None and r.request_id in verified}
        self.scheduler.update_from_output(scheduled, result)
        outputs = []
        for req_id, request, token_id, logprobs in zip(result.req_ids, requests, result.sampled_token_ids, result.logprobs):
            if request is None:
                continue  # aborted or finished while the step ran
            new_token_ids = [] if token_id is None else [token_id]
            if req_id in num_before:  # a verify step: the tokens the scheduler kept (up to a stop)
                new_token_ids = request.output_token_ids[num_before[req_id] :]
                logprobs = truncated_logprobs(logprobs, len(new_token_ids))
            self.num_generation_tokens += len(new_token_ids)
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    prompt_logprobs=result.prompt_logprobs.get(req_id),
                    finish_reason=request.status.value if request.is_finished else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    kv_transfer_params=request.kv_transfer_params if request.is_finished else None,
                )
            )
        return outputs

    def _abort_failed_step(self, scheduled: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step that raised aborts the requests in it (their KV blocks are freed and the
        workers drop them next step) instead of taking the engine down; several failures in a
        row mean the device itself is broken, and the error propagates (at once where a worker
        process died)."""
        self.num_failed_steps += 1
        if self.num_failed_steps >= MAX_FAILED_STEPS or isinstance(error, WorkerDiedError):
            raise error
        req_ids = list(scheduled.num_scheduled_tokens)
        logger.error("a step failed; aborting its %d requests", len(req_ids), exc_info=error)
        aborted = self.scheduler.abort_requests(req_ids)
        self.kv_cache.forget_free_blocks()
        return [
            EngineCoreOutput(r.request_id, [], None, None, "abort", "engine error", max(r.num_cached_tokens, 0))
            for r in aborted
        ]

    def set_phase_timing(self, enabled: bool) -> None:
        """Time the parts of each step (scheduling, launch and its pieces, the wait for
        results, the update) until turned off; ``phase_times`` reads them."""
        if enabled:
            self._timer.enable([
                (self.executor, "launch", "launch"),
                (self.executor, "fetch", "fetch_wait"),
                (self.scheduler, "schedule", "schedule"),
                (self.scheduler, "update_from_output", "update"),
            ])
        else:
            self._timer.disable()
        self.executor.set_phase_timing(enabled)

    def phase_times(self) -> dict[str, float]:
        """Host seconds per step part since the last call."""
        return self._timer.take() | self.executor.phase_times()

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
            num_steps=self.num_steps_launched,
            external_prefix_cache_queries=self.scheduler.num_external_queries,
            external_prefix_cache_hits=self.scheduler.num_external_hits,
            num_kv_load_failures=self.scheduler.num_kv_load_failures,
            **spec_decode_stats_fields(self.scheduler.spec_stats),
            lora_registry_version=self.loras.version,
        )
