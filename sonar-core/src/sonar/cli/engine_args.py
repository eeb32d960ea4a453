"""The engine options shared by every subcommand that loads a model."""

from __future__ import annotations

import argparse

from sonar.config import EngineArgs


def add_engine_arguments(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    defaults = EngineArgs()
    if with_model:
        parser.add_argument("model", nargs="?", default=None, help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder, when not the model's own")
    group.add_argument("--dtype", default=defaults.dtype, help="auto, float32, bfloat16 or float16")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    group.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV-cache block")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="exact KV-cache budget in bytes")
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization, help="fraction of device memory for weights and KV cache")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV blocks of shared prefixes")
    group.add_argument("--load-format", default=defaults.load_format, help="auto, safetensors, gguf or dummy (random weights)")
    group.add_argument("--skip-tokenizer-init", action="store_true", help="serve token ids only")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed for random weights (load_format=dummy) and engine-level randomness")
    group.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=defaults.async_scheduling,
        help="schedule and launch each step while the one before it still runs on the device (default: on for accelerators, off on the CPU)",
    )
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=defaults.data_parallel_size,
        help="engine-core replicas, each in its own process on its own device (on the CPU: its share of the cores); requests go to the least loaded",
    )
    group.add_argument(
        "--scheduling-policy", default=defaults.scheduling_policy,
        help="fcfs (first come, first served) or priority (a request's `priority`: lower runs first, FCFS among equals), or a plugin's policy",
    )
    group.add_argument("--kv-cache-manager", default=defaults.kv_cache_manager, help="the KV-cache manager: paged, or a plugin's")
    group.add_argument(
        "--distributed-executor-backend", default=None,
        help="what runs the engine core's workers: uni (one worker in the engine core's process), or a plugin's",
    )
    group.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs, help="largest logprobs / prompt_logprobs a request may ask for")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=getattr(args, "model", None),
        tokenizer=args.tokenizer,
        served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        async_scheduling=args.async_scheduling,
        data_parallel_size=args.data_parallel_size,
        scheduling_policy=args.scheduling_policy,
        kv_cache_manager=args.kv_cache_manager,
        distributed_executor_backend=args.distributed_executor_backend,
    )
