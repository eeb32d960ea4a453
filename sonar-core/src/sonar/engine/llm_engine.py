"""The synchronous engine: input processing, an engine-core client, output processing."""

from __future__ import annotations

import logging
import queue
import weakref
from typing import Any

from sonar.config import EngineArgs, EngineConfig, ModelConfig
from sonar.engine.process_util import freeze_startup_heap
from sonar.engine.core_client import EngineProcesses, InprocCoreClient, MPCoreClient, client_addresses, lora_reply_result, new_ipc_dir
from sonar.engine.engine_core import EngineCore
from sonar.engine.input_processor import InputProcessor, PromptType
from sonar.engine.output_processor import OutputProcessor
from sonar.engine.request_stats import RequestStats
from sonar.engine.resolve import model_config_of, resolve_engine_config
from sonar.engine.scheduler_metrics import scheduler_metrics
from sonar.engine.wire import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from sonar.lora.request import LoRARequest
from sonar.metrics import Metric
from sonar.outputs import RequestOutput
from sonar.platform import Platform, current_platform
from sonar.sampling_params import SamplingParams
from sonar.worker.phase_timer import PhaseTimer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """Admits requests, steps the engine core, and turns its token outputs into
    ``RequestOutput``s. With ``data_parallel_size`` 1 the engine core runs in this process;
    above 1 each replica runs in its own process and requests go to the least loaded one."""

    def __init__(self, args: EngineArgs, platform: type[Platform] | None = None) -> None:
        self.args = args
        self.platform = platform or current_platform()
        self.config, self.tokenizer = resolve_engine_config(args, self.platform)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.request_stats = RequestStats()
        self.output_processor = OutputProcessor(self.tokenizer, self.request_stats)
        self.scheduler_config = self.config.scheduler_config
        self._timer = PhaseTimer()
        self._served_loras: dict[int, LoRARequest] = {}  # adapters added through this engine (skips re-adding per request)
        self.core: EngineCore | None = None
        if self.config.data_parallel_size == 1:
            self.core = EngineCore.from_config(self.config, self.platform)
            self.model_config: ModelConfig = self.core.model_config
            self.client: InprocCoreClient | _ReplicaClient = InprocCoreClient(self.core)
            # the engine core steps in this process: its startup heap (model, graphs, compiled
            # kernels) is frozen as in the core process, or full collections walk it mid-run
            freeze_startup_heap()
        else:
            self.model_config = model_config_of(self.config)
            self.client = _ReplicaClient(self.config, self.platform)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def get_tokenizer(self) -> Any:
        """The tokenizer requests are encoded and decoded with (None with ``skip_tokenizer_init``)."""
        return self.tokenizer

    # -- input ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ``lora_request`` names the LoRA adapter it runs with (added first
        where the engine does not serve it yet).

        :raises ValueError: the request is invalid (the message says why).
        :raises LoRAError: its adapter cannot be served.
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.input_processor.check_lora(lora_request)
        if lora_request is not None and self._served_loras.get(lora_request.lora_int_id) != lora_request:
            self.add_lora(lora_request)
        processed = self.input_processor.process(request_id, prompt, params, priority=priority, lora_request=lora_request)
        self.output_processor.add(
            request_id, processed.prompt, processed.prompt_token_ids, processed.params, processed.child_ids, processed.child_params
        )
        self.client.add(processed.core_requests)

    def encode(self, text: str) -> list[int]:
        return self.input_processor.encode(text)

    # -- LoRA adapters -------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serve a LoRA adapter (read and checked now, in every engine core); False where
        this very adapter is served already.

        :raises LoRAError: it cannot be served (a missing or pickled file, an unsupported
            PEFT option, a rank above ``max_lora_rank``, shapes of another base model), or
            LoRA is off.
        """
        self.input_processor.check_lora(lora_request)
        changed = self.client.add_lora(lora_request)
        self._served_loras[lora_request.lora_int_id] = lora_request
        return changed

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter; False where it is not served. One that running or waiting
        requests use takes no new requests and is dropped once they finish (stepping them
        finishes them), so no request breaks."""
        self._served_loras.pop(lora_int_id, None)
        return self.client.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters served."""
        return {r.lora_int_id for r in self.client.list_loras()}

    def get_loras(self) -> list[LoRARequest]:
        """The adapters served, by id."""
        return self.client.list_loras()

    def lora_removal_pending(self, lora_int_id: int) -> bool:
        """Whether a removed adapter still waits for its requests to finish."""
        return self.client.lora_removal_pending(lora_int_id)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint (thread-safe; off the step loop).

        :raises ValueError: the constraint is invalid or did not compile within the time limit.
        """
        self.input_processor.compile_grammar(params)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            self.client.abort(self.output_processor.child_ids(request_id))
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self.client.step()
        outputs, to_stop = self.output_processor.process(core_outputs)
        if to_stop:  # a stop string ended these: the engine core lets them go
            self.client.abort([child_id for child_id, _ in to_stop])
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_stats(self) -> SchedulerStats:
        return self.client.get_stats()

    def get_metrics(self) -> list[Metric]:
        """Snapshots of the metrics ``/metrics`` would show for this engine (``sonar.metrics``):
        this frontend's requests (finishes, tokens, latencies) and the engine cores' stats
        (summed over data-parallel replicas, as of each one's latest report)."""
        labels = {"model_name": self.config.served_name}
        spec_decode = self.config.speculative_config is not None
        return self.request_stats.metrics(labels) + scheduler_metrics(self.get_stats(), labels, spec_decode)

    # -- benchmarks ----------------------------------------------------------------------

    def set_phase_timing(self, enabled: bool) -> None:
        """Time the host's part of each step, piece by piece (``phase_times`` reads them):
        the engine core's scheduling, launch, wait and update, the worker's parts of the
        launch, and the output processing here. In-process engine cores only."""
        core = self._local_core("phase timing")
        core.set_phase_timing(enabled)
        if enabled:
            self._timer.enable([(self.output_processor, "process", "output_processing")])
        else:
            self._timer.disable()

    def phase_times(self) -> dict[str, float]:
        """Host seconds per step part since the last call."""
        return self._local_core("phase timing").phase_times() | self._timer.take()

    def device_benchmarks(self) -> dict[str, float]:
        """Device-only timings the engine core's workers can take (e.g. a decode-graph
        replay), in milliseconds by label."""
        return self._local_core("device benchmarks").executor.device_benchmarks()

    def memory_profile(self) -> dict[str, int]:
        """What the workers measured before sizing the KV cache (bytes by label) and the cache
        they sized."""
        core = self._local_core("the memory profile")
        report = dict(core.executor.profile_report())
        report["kv_cache_blocks"] = core.cache_config.num_blocks
        report["kv_cache_bytes"] = core.cache_config.num_blocks * core.executor.kv_bytes_per_block()
        return report

    def _local_core(self, what: str) -> EngineCore:
        if self.core is None:
            raise RuntimeError(f"{what} needs the engine core in this process (data_parallel_size=1)")
        return self.core

    def shutdown(self) -> None:
        self.client.close()


class _ReplicaClient:
    """Engine-core processes stepped from a synchronous caller: ``step`` waits for the next
    message of outputs from any replica."""

    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        from sonar.engine.process_util import forks_children

        self._ipc_dir = new_ipc_dir()
        addresses = client_addresses(self._ipc_dir, 0)
        self.processes = EngineProcesses(
            config, [addresses], platform.replica_env, logging.getLevelName(logging.getLogger().level), fork=forks_children(platform)
        )
        self._received: queue.Queue[EngineCoreOutputs | str] = queue.Queue()
        self._engine_of: dict[str, int] = {}
        try:
            received = self._received  # the callbacks hold the queue, not self (the finalizer needs self free)
            self.mp = MPCoreClient(
                addresses, 0, config.data_parallel_size, received.put,
                lambda index, reason: received.put(f"engine core {index} died: {reason}"), self.processes.check_started,
            )
        except BaseException:
            self.processes.terminate()
            raise
        self._finalizer = weakref.finalize(self, _stop_replicas, self.mp, self.processes)  # also when dropped

    def add(self, requests: list[Any]) -> None:
        engine = self.mp.choose_engine()
        for request in requests:
            self._engine_of[request.request_id] = engine
        self.mp.add(engine, requests)

    def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._engine_of.pop(request_id, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self.mp.abort(engine, ids)

    def step(self) -> list[EngineCoreOutput]:
        item = self._received.get()
        if isinstance(item, str):
            raise RuntimeError(item)
        for output in item.outputs:
            if output.finish_reason is not None:
                self._engine_of.pop(output.req_id, None)
        return item.outputs

    def get_stats(self) -> SchedulerStats:
        return self.mp.get_stats()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return lora_reply_result([f.result() for f in self.mp.call_lora_everywhere("add", lora_request)])

    def remove_lora(self, lora_int_id: int) -> bool:
        """Returns once every engine core has dropped it (they step its requests to the end)."""
        return lora_reply_result([f.result() for f in self.mp.call_lora_everywhere("remove", lora_int_id=lora_int_id)])

    def list_loras(self) -> list[LoRARequest]:
        engine = self.mp.choose_engine()
        return lora_reply_result_loras(self.mp.call_lora(engine, "list").result())

    def lora_removal_pending(self, lora_int_id: int) -> bool:
        return False  # remove_lora waited for it

    def close(self) -> None:
        self._finalizer()


def lora_reply_result_loras(reply: Any) -> list[LoRARequest]:
    lora_reply_result([reply])
    return list(reply.loras)


def _stop_replicas(mp: MPCoreClient, processes: EngineProcesses) -> None:
    mp.shutdown_engines()
    mp.close()  # the receiver stops first: replicas that exit now are not reported dead
    processes.terminate()
