"""``EngineArgs`` resolved once into an ``EngineConfig``: the model file and its format, the
tokenizer, dtype, lengths, cache and scheduler settings. Both sides of the engine-core process
boundary start from the result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sonar.config import KV_CACHE_DTYPES, EngineArgs, EngineConfig, ModelConfig, default_model_path, dtype_name, resolve_dtype
from sonar.engine.generation_defaults import default_sampling_of
from sonar.engine.model_source import check_remote_code, resolve_model_path, stretched_context
from sonar.kv_transfer.factory import resolve_kv_transfer_config
from sonar.platform import Platform
from sonar.spec_decode.resolve import resolve_speculative_config
from sonar.registry import architecture_of, executors, kv_cache_managers, resolve_model_class, scheduler_policies, weight_formats


def _registered(option: str, name: str, registered: dict[str, Any]) -> str:
    if name not in registered:
        raise ValueError(f"{option}={name!r} is not registered; registered: {', '.join(sorted(registered))} (install the plugin that provides it)")
    return name


def select_weight_format(model_path: Path, load_format: str) -> tuple[str, Any]:
    formats = weight_formats()
    if load_format != "auto":
        if load_format not in formats:
            raise ValueError(f"unknown load_format {load_format!r}; registered: {sorted(formats)}")
        return load_format, formats[load_format]
    for name, fmt in formats.items():
        if fmt.detect(model_path):
            return name, fmt
    raise ValueError(f"no registered weight format reads {model_path} (registered: {sorted(formats)})")


def _eos_token_ids(model_path: Path, hf_config: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)

    add(getattr(hf_config, "eos_token_id", None))
    generation_config = model_path / "generation_config.json" if model_path.is_dir() else None
    if generation_config is not None and generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def resolve_quantization(forced: str | None, hf_config: Any, platform: str) -> str | None:
    """The quantization method the model runs: ``forced`` (``quantization=``) or the
    checkpoint's ``quantization_config.quant_method``; None where neither names one (a GGUF
    file is dequantized at load and names none).

    :raises ValueError: the method is not registered (the message lists those that are), or
        ``platform`` cannot run it (the message names the platforms that can).
    """
    from sonar.quantization import quant_config_of
    from sonar.registry import load_registered, quantization_methods

    declared = (quant_config_of(hf_config) or {}).get("quant_method")
    name = forced if forced is not None and forced.lower() != "none" else declared
    if name is None:
        return None
    registered = quantization_methods()
    if name not in registered:
        source = f"quantization={name!r}" if name == forced else f"the checkpoint's quantization_config.quant_method {name!r}"
        raise ValueError(
            f"{source} is not a registered quantization method; registered: {', '.join(sorted(registered))} "
            f"(install the plugin that provides it)"
        )
    method_cls = load_registered("quantization method", name, registered)
    if not method_cls.runs_on(platform):
        raise ValueError(
            f"quantization method {name!r} does not run on the {platform!r} platform; "
            f"platforms that run it: {', '.join(method_cls.platforms)}"
        )
    return name


def resolve_kv_cache_dtype(requested: str, platform: type[Platform]) -> str:
    """The canonical KV-cache dtype (``"auto"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``) for
    ``kv_cache_dtype=requested``.

    :raises ValueError: an unknown name, or one ``platform``'s attention backend cannot run.
    """
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {requested!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    canonical = KV_CACHE_DTYPES[requested]
    if canonical not in platform.kv_cache_dtypes:
        raise ValueError(
            f"kv_cache_dtype={requested!r} is not supported on the {platform.name!r} platform; "
            f"it supports {', '.join(platform.kv_cache_dtypes)}"
        )
    return canonical


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer the frontend tokenizes and detokenizes with (None: skip_tokenizer_init)."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.tokenizer)
    _, fmt = select_weight_format(Path(config.model), config.load_format)
    return fmt.load_tokenizer(Path(config.model))


def resolve_engine_config(args: EngineArgs, platform: type[Platform]) -> tuple[EngineConfig, Any]:
    """Resolve ``args`` for ``platform``; returns the config and the loaded tokenizer (or None).

    Reads the model's config and tokenizer files only, never its weights, so a bad argument
    is refused before anything heavy is loaded.
    """
    model_path = resolve_model_path(args.model or default_model_path(), args.revision, args.download_dir)
    check_remote_code(model_path, args.trust_remote_code)
    format_name, fmt = select_weight_format(model_path, args.load_format)
    hf_config = load_model_hf_config(fmt, model_path, args.hf_overrides)  # an unsupported model fails here
    if args.tensor_parallel_size > 1 and not getattr(resolve_model_class(hf_config), "supports_tensor_parallel", False):
        raise ValueError(
            f"{architecture_of(hf_config)} does not run with tensor parallelism yet "
            f"(tensor_parallel_size={args.tensor_parallel_size}); use tensor_parallel_size=1"
        )
    if args.enable_expert_parallel and not getattr(resolve_model_class(hf_config), "supports_expert_parallel", False):
        raise ValueError(
            f"enable_expert_parallel splits the experts of a mixture-of-experts model over the tensor-parallel ranks, "
            f"and {architecture_of(hf_config)} has none; leave enable_expert_parallel off"
        )
    if args.pipeline_parallel_size > 1:
        _check_pipeline(args.pipeline_parallel_size, hf_config)
    quantization = resolve_quantization(args.quantization, hf_config, platform.name)
    tokenizer = None
    if not args.skip_tokenizer_init:
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        else:
            tokenizer = fmt.load_tokenizer(model_path)
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    derived_len = stretched_context(getattr(hf_config, "max_position_embeddings", None) or 2048, rope)
    max_model_len = args.max_model_len or derived_len
    if max_model_len > derived_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {derived_len} tokens")
    max_num_batched_tokens = args.max_num_batched_tokens or max(2048, min(max_model_len, 8192))
    if not args.enable_chunked_prefill:  # every prompt is prefilled in one step: the budget holds the longest
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens={args.max_num_batched_tokens} must be at least "
                f"max_model_len={max_model_len} (a prompt is prefilled in one step); raise it, lower max_model_len, or keep chunked prefill on"
            )
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    speculative_config = resolve_speculative_config(args.speculative_config)
    # with speculation, the engine core still overlaps steps too large to carry drafts
    async_scheduling = platform.async_scheduling if args.async_scheduling is None else args.async_scheduling
    config = EngineConfig(
        model=str(model_path),
        served_name=args.served_model_name or (args.model or "SmolLM2-135M-Instruct"),
        load_format=format_name,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        dtype=dtype_name(resolve_dtype(args.dtype, hf_config, platform.supported_dtypes)),
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=tuple(_eos_token_ids(model_path, hf_config, tokenizer)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=async_scheduling,
        max_logprobs=args.max_logprobs,
        seed=args.seed,
        data_parallel_size=args.data_parallel_size,
        platform=platform.name,
        scheduling_policy=_registered("scheduling_policy", args.scheduling_policy, scheduler_policies()),
        kv_cache_manager=_registered("kv_cache_manager", args.kv_cache_manager, kv_cache_managers()),
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        executor=_registered("distributed_executor_backend", _executor_name(args), executors()),
        default_sampling=default_sampling_of(model_path, args.generation_config, args.override_generation_config),
        hf_overrides=args.hf_overrides,
        quantization=quantization,
        kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, platform),
        speculative_config=speculative_config,
        kv_transfer_config=resolve_kv_transfer_config(args.kv_transfer_config, args.kv_offload_bytes, args.kv_transfer_timeout),
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        enforce_eager=args.enforce_eager,
    )
    return config, tokenizer


def _executor_name(args: EngineArgs) -> str:
    """The executor ``distributed_executor_backend`` names, by default ``uni`` for one device
    and ``mp`` (a process per rank) for tensor parallelism, which only the latter runs."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    name = args.distributed_executor_backend or ("mp" if tp * pp > 1 else "uni")
    if pp > 1:
        if name == "uni":
            raise ValueError(f"pipeline_parallel_size={pp} needs a process per rank: use distributed_executor_backend='mp'")
    if tp > 1:
        if name == "uni":
            raise ValueError(f"tensor_parallel_size={tp} needs a process per rank: use distributed_executor_backend='mp'")
    if args.nnodes > 1 and name != "mp":
        raise ValueError(f"nnodes={args.nnodes} runs the ranks through the mp executor; drop distributed_executor_backend={name!r}")
    return name


def _check_pipeline(pp: int, hf_config: Any) -> None:
    """Refuse, before any process starts, a model that does not split into stages and a
    partition of its layers that does not fit (``sonar.pipeline.partition_layers``)."""
    from sonar.pipeline import partition_layers

    if not getattr(resolve_model_class(hf_config), "supports_pipeline_parallel", False):
        raise ValueError(
            f"{architecture_of(hf_config)} does not run with pipeline parallelism yet "
            f"(pipeline_parallel_size={pp}); use pipeline_parallel_size=1"
        )
    partition_layers(hf_config.num_hidden_layers, pp)


def load_model_hf_config(fmt: Any, model_path: Path, overrides: dict[str, Any] | None) -> Any:
    """The config the model is built from: the files' (``overrides`` laid over it), or, for an
    architecture whose class serves only the language model of a composite checkpoint, the
    part its ``language_model_config(hf_config)`` returns.

    :raises ValueError: no registered architecture runs it.
    """
    hf_config = apply_hf_overrides(fmt.load_hf_config(model_path), overrides)
    architecture_of(hf_config)
    language_model_config = getattr(resolve_model_class(hf_config), "language_model_config", None)
    return language_model_config(hf_config) if language_model_config is not None else hf_config


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> Any:
    """``hf_config`` with ``overrides`` (vLLM's ``hf_overrides``) laid over it: a field holding
    a nested config (``text_config``) takes a mapping field by field; any other is replaced."""
    for name, value in (overrides or {}).items():
        current = getattr(hf_config, name, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):  # a nested PretrainedConfig
            apply_hf_overrides(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(hf_config, name, {**current, **value})
        else:
            try:
                setattr(hf_config, name, value)
            except Exception as exc:  # transformers validates some fields on assignment (its own error types)
                raise ValueError(f"hf_overrides {name}={value!r} does not fit the model's config: {exc}") from None
    return hf_config


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The model config the workers load from (reads the model's config file again)."""
    _, fmt = select_weight_format(Path(config.model), config.load_format)
    hf_config = load_model_hf_config(fmt, Path(config.model), config.hf_overrides)
    if config.quantization in (None, "unquantized"):
        hf_config.quantization_config = None  # forced unquantized: the weights must come as floats
    return ModelConfig(
        model=config.model,
        served_name=config.served_name,
        hf_config=hf_config,
        dtype=config.torch_dtype,
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
        load_format=config.load_format,
        eos_token_ids=list(config.eos_token_ids),
        quantization=config.quantization,
        enable_lora=config.enable_lora,
    )
