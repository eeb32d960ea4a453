"""Runs one worker in this process."""

from __future__ import annotations

from typing import Any

from sonar.config import ModelConfig
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.platform import Platform
from sonar.registry import import_class


class UniprocExecutor:
    def __init__(self, platform: type[Platform], model_config: ModelConfig, block_size: int) -> None:
        worker_cls = import_class(platform.worker_cls)
        self.worker = worker_cls(platform, model_config, block_size)
        self.worker.load_model()

    def determine_num_blocks(self, kv_cache_memory_bytes: int | None, utilization: float) -> int:
        budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else self.worker.available_kv_cache_bytes(utilization)
        return budget // self.worker.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        """Start the step; ``fetch`` the returned handle for its results."""
        return self.worker.launch(scheduler_output)

    def fetch(self, handle: Any) -> ModelRunnerOutput:
        return self.worker.fetch(handle)
