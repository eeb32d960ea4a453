"""The executor interface: what runs the workers of one engine core."""

from __future__ import annotations

from typing import Any

from sonar.config import EngineConfig, ModelConfig
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.engine.step_cost import StepCostModel
from sonar.platform import Platform


class WorkerDiedError(RuntimeError):
    """A worker process of the executor died or stopped answering: the engine cannot go on
    (the engine core fails instead of retrying the step)."""


class Executor:
    """Runs an engine core's workers: one in-process worker, or one worker per device of a
    parallel group in processes of their own. Registered through ``sonar_register_executors``
    and selected by ``distributed_executor_backend``.

    The engine core drives it in this order: construction (the workers load the model), then
    ``kv_cache_specs`` and ``available_kv_cache_bytes`` (after profiling a step of the
    largest shape the configuration allows), ``init_kv_cache`` with the block count the core
    chose, ``profile_step_costs`` where the verification policy needs it, then ``launch``/``fetch`` once per step, and ``shutdown`` at the end. Every worker
    sees the same ``SchedulerOutput``; ``fetch`` returns the output of the worker that
    samples (rank 0).

    :param config: the engine configuration, resolved once.
    :param model_config: the model the workers load.
    :param platform: the platform the workers run on.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, platform: type[Platform]) -> None:
        self.config = config
        self.model_config = model_config
        self.platform = platform

    def kv_cache_specs(self) -> list[Any] | None:
        """The model's ``KVCacheSpec`` per layer (None: full attention in every layer)."""
        raise NotImplementedError

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes across the layers a worker holds."""
        raise NotImplementedError

    def available_kv_cache_bytes(self) -> int:
        """Bytes each worker can give its KV cache: profiles the largest step, then applies
        ``gpu_memory_utilization`` (or returns ``kv_cache_memory_bytes`` where set)."""
        raise NotImplementedError

    def available_kv_blocks(self) -> int:
        """KV blocks every worker's budget holds: ``available_kv_cache_bytes`` over
        ``kv_bytes_per_block`` (an executor whose workers hold different layers, as pipeline
        stages do, takes the fewest over them)."""
        return self.available_kv_cache_bytes() // self.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks in every worker (and whatever depends on them)."""
        raise NotImplementedError

    def profile_step_costs(self, max_tokens: int) -> StepCostModel:
        """The target's forward-step time by tokens per step, up to ``max_tokens``, measured
        by the workers on their devices once ``init_kv_cache`` ran (rank 0's, for a group that
        steps together). Called only where a policy needs it (confidence-scheduled
        verification)."""
        raise NotImplementedError(f"the {type(self).__name__} executor does not profile step costs")

    def kv_cache_layout(self) -> Any:
        """The allocated KV cache as a KV connector sees it (a ``KVCacheLayout``), once
        ``init_kv_cache`` ran."""
        raise NotImplementedError(f"the {type(self).__name__} executor does not support KV connectors")

    def kv_connector_handshake(self) -> dict[str, Any] | None:
        """What the workers' KV connector halves publish for the scheduler half (rank 0's)."""
        raise NotImplementedError(f"the {type(self).__name__} executor does not support KV connectors")

    def add_lora(self, lora_request: Any) -> None:
        """Have every worker read, check and keep a LoRA adapter (a ``LoRARequest``).

        :raises LoRAError: the adapter cannot be served on this model.
        """
        raise NotImplementedError(f"the {type(self).__name__} executor does not support LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> None:
        """Have every worker drop an adapter (no request uses it any more)."""
        raise NotImplementedError(f"the {type(self).__name__} executor does not support LoRA adapters")

    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        """Start one step on the workers and return a handle without waiting for it. With
        pipeline parallelism several steps are launched before the first is fetched; they
        are fetched in the order they were launched."""
        raise NotImplementedError

    def fetch(self, handle: Any) -> ModelRunnerOutput:
        """Wait for a launched step and return its output."""
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.fetch(self.launch(scheduler_output))

    def set_phase_timing(self, enabled: bool) -> None:
        """Turn on (or off) timing of the parts of each step in the workers, for benchmarks."""

    def phase_times(self) -> dict[str, float]:
        """Host seconds per step part since the last call (``{}`` when not timing)."""
        return {}

    def device_benchmarks(self) -> dict[str, float]:
        """Device-only timings the workers can take (milliseconds by label; may be empty)."""
        return {}

    def profile_report(self) -> dict[str, int]:
        """What the memory profile measured, in bytes (``{}`` where nothing was profiled)."""
        return {}

    def shutdown(self) -> None:
        """Release the workers."""
