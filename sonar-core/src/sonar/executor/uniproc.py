"""Runs one worker in the engine core's own process."""

from __future__ import annotations

from typing import Any

from sonar.config import EngineConfig, ModelConfig
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.engine.step_cost import StepCostModel
from sonar.executor.base import Executor
from sonar.platform import Platform
from sonar.registry import import_class
from sonar.worker.phase_timer import PhaseTimer


class UniprocExecutor(Executor):
    """One worker, called directly: a step's launch queues its device work and returns."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, platform: type[Platform]) -> None:
        super().__init__(config, model_config, platform)
        worker_cls = import_class(platform.worker_cls)
        self.worker = worker_cls(platform, model_config, config)
        self.worker.load_model()
        self._timer = PhaseTimer()

    def kv_cache_specs(self) -> list[Any] | None:
        return self.worker.kv_cache_specs()

    def kv_bytes_per_block(self) -> int:
        return self.worker.kv_bytes_per_block()

    def available_kv_cache_bytes(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        return self.worker.available_kv_cache_bytes(self.config.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def profile_step_costs(self, max_tokens: int) -> StepCostModel:
        return self.worker.profile_step_costs(max_tokens)

    def kv_cache_layout(self) -> Any:
        return self.worker.kv_cache_layout()

    def kv_connector_handshake(self) -> dict[str, Any] | None:
        return self.worker.kv_connector_handshake()

    def shutdown(self) -> None:
        self.worker.shutdown_kv_connector()

    def add_lora(self, lora_request: Any) -> None:
        self.worker.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.worker.remove_lora(lora_int_id)

    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        return self.worker.launch(scheduler_output)

    def fetch(self, handle: Any) -> ModelRunnerOutput:
        return self.worker.fetch(handle)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def set_phase_timing(self, enabled: bool) -> None:
        if enabled:
            self._timer.enable(self.worker.model_runner.phase_targets())
        else:
            self._timer.disable()

    def phase_times(self) -> dict[str, float]:
        return self._timer.take()

    def device_benchmarks(self) -> dict[str, float]:
        return self.worker.model_runner.device_benchmarks()

    def profile_report(self) -> dict[str, int]:
        return self.worker.profile_report()
