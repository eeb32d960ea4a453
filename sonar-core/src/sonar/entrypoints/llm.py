"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine, PromptType
from sonar.lora.request import LoRARequest
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
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(args)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

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
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
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
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **chat_template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, chat_template, add_generation_prompt, **chat_template_kwargs)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

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
