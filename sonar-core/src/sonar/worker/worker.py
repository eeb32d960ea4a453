"""A worker owns one device: it loads the model, holds its KV cache and runs steps."""

from __future__ import annotations

from typing import Any

import torch

from sonar import ops
from sonar.config import EngineConfig, ModelConfig
from sonar.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sonar.engine.step_cost import StepCostModel, profile_token_counts
from sonar.platform import Platform
from sonar.worker.model_runner import LaunchedStep, ModelRunner


class Worker:
    """The generic torch worker. Platforms subclass it to set up their device
    (threads, streams, graphs) and may swap in their own model runner."""

    model_runner_cls = ModelRunner

    def __init__(self, platform: type[Platform], model_config: ModelConfig, config: EngineConfig, rank: int = 0) -> None:
        self.platform = platform
        self.model_config = model_config
        self.config = config
        self.rank = rank
        self.device = platform.device(rank)
        self.init_device()
        ops.install_platform_ops(platform)
        self.model_runner = self.model_runner_cls(model_config, config, self.device, platform.attention_backend_cls)
        self._profile: dict[str, int] = {}

    def init_device(self) -> None:
        """Prepare the device before the model is loaded."""

    def load_model(self) -> None:
        torch.manual_seed(0)
        self.model_runner.load_model()

    def kv_cache_specs(self) -> list[Any] | None:
        return self.model_runner.kv_cache_specs()

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def available_kv_cache_bytes(self, utilization: float) -> int:
        """How much memory the KV cache may take: ``utilization`` of the device, less what the
        weights hold and what the largest step needs on top of them (measured by running it
        where the platform can measure device memory)."""
        platform = self.platform
        step_bytes = 0
        if platform.measures_memory:
            step_bytes = self.model_runner.profile_peak_bytes(platform)
            platform.release_cached_memory()
        budget = platform.kv_cache_budget_bytes(utilization, reserved_bytes=step_bytes)
        self._profile = {"reserved_for_steps_bytes": step_bytes, "kv_cache_budget_bytes": budget}
        return budget

    def profile_report(self) -> dict[str, int]:
        return self._profile | self.model_runner.profile_parts

    def init_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.init_kv_cache(num_blocks)

    def profile_step_costs(self, max_tokens: int) -> StepCostModel:
        """Time the target's forward step for token counts up to ``max_tokens`` on this
        device (``sonar.worker.step_profile``), once the KV cache is allocated and before any
        request runs: a geometric grid plus the counts where the runner's cost jumps (its
        largest graph and the step past it), so the curve does not average across them."""
        from sonar.worker.step_profile import profile_step_seconds

        spec = self.config.speculative_config
        rows = self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))  # decodes and drafts
        grid = set(profile_token_counts(max_tokens)) | {n for n in self.model_runner.step_cost_edges() if n <= max_tokens}
        counts, seconds, context_len = profile_step_seconds(self.model_runner, self.platform, sorted(grid), max_logits_rows=rows)
        return StepCostModel.from_samples(counts, seconds, context_len)

    def kv_cache_layout(self) -> Any:
        """The allocated KV cache as a KV connector sees it (``KVCacheLayout``)."""
        return self.model_runner.kv_cache_layout()

    def kv_connector_handshake(self) -> dict[str, Any] | None:
        """What the KV connector's worker half publishes for its scheduler half."""
        connector = self.model_runner.kv_connector
        return None if connector is None else connector.get_handshake_metadata()

    def shutdown_kv_connector(self) -> None:
        connector = self.model_runner.kv_connector
        if connector is not None:
            connector.shutdown()

    def add_lora(self, lora_request: Any) -> None:
        """Read, check and keep a LoRA adapter (``LoRAError`` where it cannot be served)."""
        self.model_runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.model_runner.remove_lora(lora_int_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        return self.model_runner.launch(scheduler_output)

    def fetch(self, step: LaunchedStep) -> ModelRunnerOutput:
        return self.model_runner.fetch(step)
