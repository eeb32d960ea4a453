"""The synchronous engine: input processing, the engine core, output processing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sonar.config import EngineArgs, ModelConfig, SchedulerConfig, default_model_path, resolve_dtype
from sonar.engine.engine_core import EngineCore, EngineStats
from sonar.engine.output_processor import OutputProcessor
from sonar.engine.request import Request
from sonar.outputs import RequestOutput
from sonar.platform import Platform, current_platform
from sonar.registry import weight_formats
from sonar.sampler.metadata import check_token_ids
from sonar.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


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


class LLMEngine:
    def __init__(self, args: EngineArgs, platform: type[Platform] | None = None) -> None:
        self.args = args
        self.platform = platform or current_platform()
        if args.quantization is not None:
            from sonar.registry import quantization_methods

            raise ValueError(
                f"quantization={args.quantization!r} is not available: no quantization method is executed yet "
                f"(registered: {sorted(quantization_methods()) or 'none'}); GGUF files are dequantized at load without it"
            )
        model_path = Path(args.model or default_model_path()).expanduser()
        if not model_path.exists():
            raise ValueError(f"model {str(model_path)!r} does not exist (give a Hugging Face folder or a .gguf file)")
        format_name, fmt = select_weight_format(model_path, args.load_format)
        hf_config = fmt.load_hf_config(model_path)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            if args.tokenizer:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            else:
                self.tokenizer = fmt.load_tokenizer(model_path)
        derived_len = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = args.max_model_len or derived_len
        if max_model_len > derived_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {derived_len} tokens")
        self.model_config = ModelConfig(
            model=str(model_path),
            served_name=args.served_model_name or (args.model or "SmolLM2-135M-Instruct"),
            hf_config=hf_config,
            dtype=resolve_dtype(args.dtype, hf_config, self.platform.supported_dtypes),
            max_model_len=max_model_len,
            vocab_size=hf_config.vocab_size,
            load_format=format_name,
            eos_token_ids=_eos_token_ids(model_path, hf_config, self.tokenizer),
        )
        max_batched = args.max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, max_batched, max_model_len)
        self.core = EngineCore(
            self.platform,
            self.model_config,
            self.scheduler_config,
            args.block_size,
            args.enable_prefix_caching,
            args.kv_cache_memory_bytes,
            args.gpu_memory_utilization,
            self.platform.async_scheduling if args.async_scheduling is None else args.async_scheduling,
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # -- input ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started with skip_tokenizer_init: send token ids, not text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; return its resolved max_tokens."""
        num_prompt = len(prompt_token_ids)
        context = self.model_config.max_model_len
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if num_prompt >= context:
            raise ValueError(f"the prompt is {num_prompt} tokens, the model's context is {context} tokens: no room to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else context - num_prompt
        if num_prompt + max_tokens > context:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds the model's context of {context} tokens (prompt is {num_prompt} tokens)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.args.max_logprobs:
                raise ValueError(f"{name}={value} exceeds max_logprobs={self.args.max_logprobs}")
        check_token_ids(params, vocab)
        if params.logits_processors:
            from sonar.registry import logits_processors

            unknown = sorted(set(params.logits_processors) - set(logits_processors()))
            if unknown:
                raise ValueError(f"logits processors {unknown} are not registered; registered: {sorted(logits_processors())}")
        return max_tokens

    def resolve_word_lists(self, params: SamplingParams) -> SamplingParams:
        """Tokenize ``bad_words`` and DRY's ``dry_sequence_breakers`` into the id fields the
        sampler reads (each bad word with and without a leading space)."""
        tokenizer = self.tokenizer
        changes: dict[str, Any] = {}
        if params.bad_words and params.bad_words_token_ids is None:
            if tokenizer is None:
                raise ValueError("bad_words needs a tokenizer; send bad_words_token_ids instead")
            sequences: list[list[int]] = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = tokenizer.encode(variant, add_special_tokens=False)
                    if ids and ids not in sequences:
                        sequences.append(ids)
            changes["bad_words_token_ids"] = sequences
        if params.dry_multiplier > 0 and params.dry_sequence_breaker_ids is None and tokenizer is not None:
            breaker_ids = {t for text in params.dry_sequence_breakers for t in tokenizer.encode(text, add_special_tokens=False)}
            changes["dry_sequence_breaker_ids"] = sorted(breaker_ids)
        return params.clone(**changes) if changes else params

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_token_ids = self.tokenize_prompt(prompt)
        params = self.resolve_word_lists(params)
        max_tokens = self.validate(prompt_token_ids, params)
        self.compile_grammar(params)  # a cache hit when the async client compiled it already
        if params.n == 1:
            child_ids, child_params = [request_id], [params]
        else:
            child_ids = [f"{i}_{request_id}" for i in range(params.n)]
            child_params = [params.clone(n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]
        self.output_processor.add(request_id, text, prompt_token_ids, params, child_ids, child_params)
        for child_id, cparams in zip(child_ids, child_params):
            self.core.add_request(
                Request(child_id, prompt_token_ids, cparams, self.model_config.eos_token_ids, max_tokens)
            )

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint (if any) into the model's grammar
        cache, where the model runner finds it. Thread-safe; call it off the step loop.

        :raises ValueError: the constraint is invalid or did not compile within the time limit.
        """
        if params.guided_decoding is None:
            return
        from sonar.structured_output.compiler import get_grammar_compiler

        config = self.model_config
        get_grammar_compiler(config.model, self.tokenizer, config.vocab_size, config.eos_token_ids).compile(params.guided_decoding)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.child_ids(request_id))
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, to_stop = self.output_processor.process(core_outputs)
        for child_id, stop in to_stop:
            self.core.finish_request(child_id, stop)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()
