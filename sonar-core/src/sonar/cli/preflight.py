"""Checks of the engine's options that need the model's files only, never torch or the
weights: run before loading, so a bad option fails in a second, not after the load."""

from __future__ import annotations

from pathlib import Path

from sonar.config import EngineArgs, default_model_path
from sonar.engine.model_source import check_remote_code, context_length_of, resolve_model_path


def check_before_loading(args: EngineArgs) -> Path:
    """Find the model's files (from the Hub cache or a download for a Hub id), then check what
    they allow: remote code, ``max_model_len`` against the model's context. Returns the path."""
    model_path = resolve_model_path(args.model or default_model_path(), args.revision, args.download_dir)
    check_remote_code(model_path, args.trust_remote_code)
    context = context_length_of(model_path)
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}")
        if context is not None and args.max_model_len > context:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens ({model_path})")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    return model_path
