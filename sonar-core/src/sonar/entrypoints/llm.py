"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from sonar.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine, PromptType
from sonar.lora.request import LoRARequest
from sonar.metrics import Metric
from sonar.outputs import RequestOutput
from sonar.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Generate from a model in this process, batching every prompt of a call together.

    ``LLM()`` with no model loads the embedded SmolLM2-135M-Instruct; ``model`` is a folder, a
    ``.gguf`` file or a Hugging Face Hub id (``revision``, ``download_dir``). Keyword arguments
    are those of ``EngineArgs`` (vLLM's names: ``dtype``, ``max_model_len``,
    ``kv_cache_memory_bytes``, ``enable_prefix_caching``, ``load_format``, ...).

    Calls without ``sampling_params`` use ``get_default_sampling_params()``: the model's
    recommended sampling (``generation_config="auto"``), else ``SamplingParams()``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **_without_no_op_vllm_args(kwargs)))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(args)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's ``LLM.reset_prefix_cache``), so the next
        prompts are computed in full: True once done; False while a request holds blocks, or
        where the engine core runs in other processes (data-parallel replicas)."""
        core = self.llm_engine.core
        return core is not None and core.kv_cache.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics (as vLLM's ``LLM.get_metrics``): ``Counter``,
        ``Gauge``, ``Histogram`` and ``Vector`` objects of ``sonar.metrics``, under the names
        ``sonar serve`` exposes on ``/metrics`` (``sonar:prompt_tokens``,
        ``sonar:request_success`` by ``finished_reason``, ``sonar:num_requests_running``,
        ``sonar:kv_cache_usage_perc``, ``sonar:time_to_first_token_seconds``, ...). Counters
        and histograms count since the engine started; stats are always kept, whatever
        ``disable_log_stats`` says."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's recommended fields (its ``generation_config.json``,
        or for the embedded model its authors' recommendation) over Sonar's defaults."""
        return SamplingParams(**self.llm_engine.config.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the finished outputs, in the prompts' order.

        ``priority`` (one per prompt; needs ``scheduling_policy="priority"``): lower runs first.
        ``lora_request`` (needs ``enable_lora=True``): the LoRA adapter every prompt runs
        with, or one per prompt (None: the base model); an adapter not served yet is added.

        :raises LoRAError: an adapter cannot be served (nothing was generated).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        engine = self.llm_engine
        request_ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, params, prio, lora in zip(request_ids, prompts, params_list, priorities, loras):
                engine.add_request(request_id, prompt, params.clone(output_kind="final_only"), priority=prio, lora_request=lora)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): each prompt's ``params.beam_width`` best
        continuations, best first (``sonar.beam_search``). Needs ``2 * beam_width`` logprobs
        a step, so ``beam_width`` up to ``max_logprobs / 2``. ``use_tqdm`` is taken for vLLM's
        signature; the steps show no progress bar."""
        if 2 * params.beam_width > self.llm_engine.config.max_logprobs:
            raise ValueError(
                f"beam_width={params.beam_width} ranks {2 * params.beam_width} tokens a step, more than max_logprobs="
                f"{self.llm_engine.config.max_logprobs}; raise max_logprobs or narrow the beam"
            )
        token_prompts = [self.llm_engine.input_processor.tokenize_prompt(prompt)[1] for prompt in _prompt_list(prompts)]
        tokenizer = self.get_tokenizer()
        return beam_search(
            lambda batch, step: self.generate(batch, step, use_tqdm=False),
            token_prompts, params, set(self.llm_engine.config.eos_token_ids), self.llm_engine.config.max_model_len,
            decode=tokenizer.decode if tokenizer is not None else None,
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating", unit="req")
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **template_variables: Any,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's arguments): each is
        rendered with the chat template (``chat_template`` instead of the tokenizer's;
        ``tools`` and ``chat_template_kwargs``, or further keyword arguments, reach it as
        template variables; ``continue_final_message``: the last message is continued, not
        closed), then generated as ``generate`` does (``lora_request`` as there). Content
        given as a list of parts is joined from its text parts; other parts are refused."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {chat_template_content_format!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        variables = {**(chat_template_kwargs or {}), **template_variables}
        if tools is not None:
            variables["tools"] = tools
        if continue_final_message:
            add_generation_prompt = False
            variables["continue_final_message"] = True
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(_text_messages(c), chat_template, add_generation_prompt, **variables)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, messages: list[Message], chat_template: str | None = None, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)


#: vLLM's ``LLM(...)`` arguments that change nothing here, with the values that mean what
#: Sonar does anyway (None: any value), as ``sonar serve`` accepts the same flags
NO_OP_VLLM_ARGS: dict[str, tuple[Any, ...] | None] = {
    "swap_space": None,  # preempted requests are recomputed (vLLM's V1 engine ignores it too)
    "max_seq_len_to_capture": None,  # decode graphs are captured by batch size, for every context length
    "disable_log_stats": None,  # the offline engine logs no periodic stats; get_metrics() works either way
    "disable_custom_all_reduce": None,  # tensor parallelism all-reduces through NCCL only
    "tokenizer_mode": ("auto",),  # the fast tokenizer
    "cpu_offload_gb": (0,),  # no weight offload
    "compilation_config": (None, 0, 1, 2, 3),  # nothing is compiled with torch.compile
    "task": (None, "auto", "generate"),  # a generating model (pooling models are not served)
    "runner": (None, "auto", "generate"),
    "convert": (None, "auto", "none"),
}


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, a list of token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _without_no_op_vllm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the vLLM arguments that change nothing here (``NO_OP_VLLM_ARGS``).

    :raises ValueError: one of them with a value Sonar would have to act on."""
    rest = {}
    for name, value in kwargs.items():
        if name not in NO_OP_VLLM_ARGS:
            rest[name] = value
            continue
        allowed = NO_OP_VLLM_ARGS[name]
        if allowed is not None and not any(value is option or (value == option and type(value) is type(option)) for option in allowed):
            raise ValueError(f"{name}={value!r} is not supported (accepted: {', '.join(repr(v) for v in allowed)}, which change nothing)")
    return rest


def _text_messages(messages: list[Message]) -> list[Message]:
    """Messages whose ``content`` is a list of parts (OpenAI's form) with the parts' texts
    joined; a part that is not text is refused (ValueError)."""
    result = []
    for number, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{number}]: content parts of type {kind!r} are not supported; send text")
                texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
        result.append(message)
    return result
