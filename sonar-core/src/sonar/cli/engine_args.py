"""The engine options shared by every subcommand that loads a model."""

from __future__ import annotations

import argparse
import json

from sonar.cli.unsupported_flags import add_unsupported_flags
from sonar.config import KV_CACHE_DTYPES, EngineArgs


def add_engine_arguments(parser: argparse.ArgumentParser, with_model: bool = True, server: bool = False) -> None:
    """Add the engine's options (vLLM's names and short forms) to ``parser``, and vLLM's flags
    Sonar has not built yet, each refusing itself (with its frontend flags too when ``server``)."""
    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    parser.add_argument("--config", default=None, metavar="YAML", help="a YAML file of flags (max-num-seqs: 64); flags on the command line win over it")
    if with_model:
        parser.add_argument(
            "model", nargs="?", default=None,
            help="Hugging Face folder, .gguf file or Hub id (org/name) (default: the embedded SmolLM2-135M-Instruct)",
        )
        group.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="the model, as vLLM takes it (instead of the positional MODEL)")
    group.add_argument("--revision", default=None, help="of a Hub id: the branch, tag or commit to use")
    group.add_argument("--download-dir", default=None, help="where Hub models are cached and downloaded (default: the Hugging Face cache)")
    group.add_argument("--trust-remote-code", action="store_true", help="allow a model whose config names code shipped with it (auto_map)")
    group.add_argument(
        "--generation-config", default=defaults.generation_config,
        help="default sampling: auto (the model's generation_config.json; for the embedded model its authors' recommendation), vllm (none), or a folder holding a generation_config.json",
    )
    group.add_argument(
        "--override-generation-config", type=_json_object, default=None, metavar="JSON",
        help='generation_config.json sampling fields laid over --generation-config\'s, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'',
    )
    group.add_argument(
        "--hf-overrides", type=_json_object, default=None, metavar="JSON",
        help='config.json fields laid over the model\'s, e.g. \'{"max_position_embeddings": 65536, "rope_scaling": {...}}\'',
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id, when not the model's own")
    group.add_argument("--dtype", default=defaults.dtype, help="auto, float32, bfloat16 or float16")
    group.add_argument("--max-model-len", type=_max_model_len, default=None, help="context length (default, 'auto' or -1: the model's; 1k = 1000, 1K = 1024, likewise m/M)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
        help="split long prompts over steps to fit the token budget (the default); --no-enable-chunked-prefill prefills each prompt in one step",
    )
    group.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV-cache block")
    group.add_argument("--kv-cache-memory-bytes", type=_byte_count, default=None, metavar="BYTES", help="exact KV-cache budget in bytes (1073741824, 1GiB, 512MiB)")
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization, help="fraction of device memory for weights and KV cache")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV blocks of shared prefixes")
    group.add_argument(
        "--quantization", "-q", default=None,
        help="the quantization method the linear layers run (default: the checkpoint's quantization_config.quant_method; unquantized: floating point, where the checkpoint can be dequantized at load, as a .gguf file can)",
    )
    group.add_argument(
        "--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=tuple(KV_CACHE_DTYPES),
        help="what the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 (FP8 E4M3 scaled by the checkpoint's per-layer k_scale / v_scale, 1.0 where it has none) or fp8_e5m2 (FP8 E5M2, unscaled: wider range, one mantissa bit less): twice the tokens per GB of bf16",
    )
    group.add_argument("--load-format", default=defaults.load_format, help="auto, safetensors, gguf or dummy (random weights)")
    group.add_argument("--skip-tokenizer-init", action="store_true", help="serve token ids only")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed for random weights (load_format=dummy) and engine-level randomness")
    group.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=defaults.async_scheduling,
        help="schedule and launch each step while the one before it still runs on the device (default: on for accelerators, off on the CPU)",
    )
    group.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=defaults.tensor_parallel_size,
        help="split each layer of a model (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE, Qwen2-MoE, Mixtral: every expert's intermediate size, or whole experts with -ep) over this many devices, one worker process each (float, FP8, GPTQ, AWQ and GGUF checkpoints; LoRA adapters too; gloo on the CPU, NCCL on GPUs)",
    )
    group.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=defaults.pipeline_parallel_size,
        help="split the layers into this many contiguous stages (an even split; SONAR_PP_LAYER_PARTITION=\"3,5\" sets it), each on its own tensor-parallel group of ranks, with up to this many steps in flight (unquantized checkpoints)",
    )
    group.add_argument(
        "--nnodes", type=int, default=defaults.nnodes,
        help="hosts the tensor-parallel ranks are split over (evenly, consecutive ranks per host); the head (--node-rank 0) serves, the others run `sonar serve ... --headless`",
    )
    group.add_argument("--node-rank", type=int, default=defaults.node_rank, help="with --nnodes: this host's place, 0 for the head")
    group.add_argument(
        "--master-addr", default=defaults.master_addr,
        help="with --nnodes: the head's address every host can reach (torch.distributed's rendezvous and the control link)",
    )
    group.add_argument(
        "--master-port", type=int, default=defaults.master_port,
        help="with --nnodes: the rendezvous port on the head; the head's control link listens on the next port (--master-port + 1)",
    )
    group.add_argument(
        "--enable-expert-parallel", "-ep", action="store_true",
        help="mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): give each of the -tp ranks E / N whole experts, tokens sent to them and back with all-to-all, instead of splitting every expert's intermediate size; attention stays tensor-parallel",
    )
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=defaults.data_parallel_size,
        help="engine-core replicas, each in its own process on its own device (with -tp N: N devices each, replica i on GPUs i*N..i*N+N-1; on the CPU: its share of the cores); requests go to the least loaded",
    )
    group.add_argument(
        "--scheduling-policy", default=defaults.scheduling_policy,
        help="fcfs (first come, first served) or priority (a request's `priority`: lower runs first, FCFS among equals), or a plugin's policy",
    )
    group.add_argument("--kv-cache-manager", default=defaults.kv_cache_manager, help="the KV-cache manager: paged, or a plugin's")
    group.add_argument(
        "--distributed-executor-backend", default=None,
        help="what runs the engine core's workers: uni (one worker in the engine core's process), mp (a process per tensor-parallel rank; the default with -tp > 1), or a plugin's",
    )
    group.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}\' (greedy output unchanged, sampled output distributed as without it); "verification": "fixed" verifies every draft, "confidence" (DSpark\'s default) per step the drafts worth their cost on a step-time curve profiled at start-up; "verify_passes": N (n-gram, DFlash, DSpark) lets a lone greedy request run up to N verify passes a step',
    )
    group.add_argument(
        "--kv-transfer-config", type=_json_object, default=None, metavar="JSON",
        help='a KV connector, as vLLM takes it: \'{"kv_connector": "SonarConnector", "kv_role": "kv_producer"}\' (kv_producer, kv_consumer or kv_both; kv_ip / kv_port: where a producer serves its blocks, 0: a free port); see docs/kv-connectors.md',
    )
    group.add_argument(
        "--kv-transfer-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
        help="with --kv-transfer-config: how long a prefill server keeps a request's blocks for its decode server to pull before freeing them (default 30; the same as kv_connector_extra_config's kv_transfer_timeout)",
    )
    group.add_argument(
        "--kv-offload-bytes", type=_byte_count, default=0, metavar="BYTES",
        help="host memory (pinned on a GPU) that keeps blocks evicted from the device prefix cache, loaded back on a later hit instead of recomputed (0: off; accepts 8GiB-style sizes)",
    )
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders, safetensors only) beside the base model; see docs/lora.md")
    group.add_argument("--max-loras", type=int, default=defaults.max_loras, help="with --enable-lora: adapters one step may use (device slots); requests of other adapters wait")
    group.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank, help="with --enable-lora: the largest adapter rank accepted (every slot is padded to it)")
    group.add_argument("--max-cpu-loras", type=int, default=None, help="with --enable-lora: adapters kept read in host memory, least recently used dropped (default: --max-loras)")
    group.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs, help="largest logprobs / prompt_logprobs a request may ask for")
    group.add_argument("--enforce-eager", action="store_true", help="capture no CUDA graphs: decode steps, short prompts and drafter passes run eagerly (slower; less memory, no capture at start-up)")
    add_unsupported_flags(parser, server=server)


def _max_model_len(text: str) -> int | None:
    """vLLM's forms: an integer, ``auto`` or -1 (the model's), or ``1k``/``1K`` (10^3 / 2^10) and
    ``m``/``M`` likewise."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return None
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    scale = units.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        parsed = float(number) if scale != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a context length: {text!r} (an integer, auto, or like 8k / 32K)") from None
    return int(parsed * scale)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout must be a positive number of seconds")
    return value


def _byte_count(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512MiB``, ``2GB``."""
    units = {"": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    try:
        count = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (examples: 1073741824, 1GiB, 512MiB)") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a byte size cannot be negative")
    return count


def model_of(args: argparse.Namespace) -> str | None:
    """The model named by the positional MODEL or ``--model`` (both: they must agree)."""
    positional, option = getattr(args, "model", None), getattr(args, "model_option", None)
    if positional and option and positional != option:
        raise ValueError(f"two models given: {positional!r} and --model {option!r}; give one")
    return positional or option


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=model_of(args),
        tokenizer=args.tokenizer,
        revision=args.revision,
        download_dir=args.download_dir,
        trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        hf_overrides=args.hf_overrides,
        served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        skip_tokenizer_init=args.skip_tokenizer_init,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        async_scheduling=args.async_scheduling,
        enforce_eager=getattr(args, "enforce_eager", False),
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        data_parallel_size=args.data_parallel_size,
        scheduling_policy=args.scheduling_policy,
        kv_cache_manager=args.kv_cache_manager,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=getattr(args, "speculative_config", None),
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
        kv_offload_bytes=getattr(args, "kv_offload_bytes", 0),
        kv_transfer_timeout=getattr(args, "kv_transfer_timeout", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
    )
