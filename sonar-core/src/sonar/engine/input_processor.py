"""The frontend's half of admitting a request: tokenization, validation against the model,
word lists turned into token ids, grammar compilation, and n > 1 fanned out into one engine-core
request per sequence. Done once, here, on whichever side of the process boundary calls it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sonar.config import EngineConfig
from sonar.engine.wire import EngineCoreRequest
from sonar.lora.errors import LoRAError
from sonar.lora.request import LoRARequest
from sonar.sampler.metadata import check_token_ids
from sonar.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, truncated_prompt

PromptType = str | list[int] | dict[str, Any]


@dataclass(slots=True)
class ProcessedRequest:
    """A validated request: what the output processor tracks and what the engine core runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str]
    child_params: list[SamplingParams]
    core_requests: list[EngineCoreRequest]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, client_index: int = 0, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Check and prepare one request (``priority``: lower runs first under the priority
        scheduling policy; any other policy accepts only 0; ``lora_request``: the adapter it
        runs with).

        :raises ValueError: the prompt or the parameters are invalid for this model (the
            message says why), or its grammar does not compile.
        :raises LoRAError: an adapter was named but the engine serves none.
        """
        params = params or SamplingParams()
        self.check_priority(priority)
        self.check_lora(lora_request)
        text, prompt_token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncated_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.config.max_model_len)
            text, prompt_token_ids = (text if kept is prompt_token_ids else None), kept
        params = self.resolve_word_lists(params)
        max_tokens = self.validate(prompt_token_ids, params)
        self.compile_grammar(params)
        if params.n == 1:
            child_ids, child_params = [request_id], [params]
        else:
            child_ids = [f"{i}_{request_id}" for i in range(params.n)]
            child_params = [params.choice(choice_seed(params.seed, i)) for i in range(params.n)]
        now = time.monotonic()  # one clock for every process of the host
        core_requests = [
            EngineCoreRequest(child_id, prompt_token_ids, cparams, max_tokens, now, client_index, priority, lora_request)
            for child_id, cparams in zip(child_ids, child_params)
        ]
        return ProcessedRequest(request_id, text, prompt_token_ids, params, child_ids, child_params, core_requests)

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if priority != 0 and not self._policy_uses_priority():
            raise ValueError(
                f"priority={priority} needs the priority scheduling policy (this engine runs "
                f"{self.config.scheduling_policy!r}; start it with --scheduling-policy priority)"
            )

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if not getattr(self.config, "enable_lora", False):
            raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")

    def _policy_uses_priority(self) -> bool:
        from sonar import registry

        policy = registry.load_registered("scheduling policy", self.config.scheduling_policy, registry.scheduler_policies())
        return bool(getattr(policy, "uses_priority", False))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init: send token ids, not text")
        return list(self.tokenizer.encode(text))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; return its resolved max_tokens."""
        num_prompt = len(prompt_token_ids)
        context = self.config.max_model_len
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= context:  # before the ids are walked: a prompt of millions is refused at once
            raise ValueError(f"the prompt is {num_prompt} tokens, the model's context is {context} tokens: no room to generate")
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else context - num_prompt
        if num_prompt + max_tokens > context:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds the model's context of {context} tokens (prompt is {num_prompt} tokens)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(self.config.max_logprobs, vocab):
                raise ValueError(f"{name}={value} exceeds max_logprobs={min(self.config.max_logprobs, vocab)}")
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
            variants = [variant for word in params.bad_words for variant in (word, " " + word.lstrip())]
            sequences: dict[tuple[int, ...], None] = {}  # first-seen order, no repeats
            for number, ids in enumerate(_encode_all(tokenizer, variants)):
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    word = params.bad_words[number // 2]
                    shown = word if len(word) <= 40 else word[:40] + "..."
                    raise ValueError(f"bad_words entry {shown!r} is {len(ids)} tokens long; a bad word may be at most {MAX_BAD_WORD_TOKENS} tokens")
                if ids:
                    sequences.setdefault(tuple(ids))
            changes["bad_words_token_ids"] = [list(ids) for ids in sequences]
        if params.dry_multiplier > 0 and params.dry_sequence_breaker_ids is None and tokenizer is not None:
            breaker_ids = {t for ids in _encode_all(tokenizer, params.dry_sequence_breakers) for t in ids}
            changes["dry_sequence_breaker_ids"] = sorted(breaker_ids)
        return params.clone(**changes) if changes else params

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint (if any) into the model's grammar
        cache. In another process the engine core compiles it again from the same spec (a
        cache hit for repeated specs); here it is checked, so an invalid one fails before
        anything is queued.

        :raises ValueError: the constraint is invalid or did not compile within the time limit.
        """
        if params.guided_decoding is None:
            return
        from sonar.structured_output.compiler import get_grammar_compiler

        config = self.config
        get_grammar_compiler(config.model, self.tokenizer, config.vocab_size, list(config.eos_token_ids)).compile(params.guided_decoding)


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids without special tokens, as ``tokenizer.encode`` gives them, in one
    batched call where the tokenizer takes one."""
    if not texts:
        return []
    if callable(tokenizer) and getattr(tokenizer, "is_fast", False):
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed`` and ``n`` > 1: ``seed + index``,
    wrapped past the largest 64-bit seed (``2**64 - 1``) back to 0."""
    if seed is None:
        return None
    seed += index
    return seed - 2**64 if seed >= 2**64 else seed
