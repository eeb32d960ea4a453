"""OpenAI request bodies. Extra fields are allowed: those naming engine sampling fields are
used, the rest ignored (clients send vendor fields)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, WithJsonSchema, model_validator

from sonar_server.list_limits import Items, batch_bounded, context_bounded

# A completion's prompt: text, token ids, or a list of either. Strict members tried in order:
# a long list of ids is checked once. (A smart union validates it against every member in full,
# 0.18 s for 700,000 ids, on the event loop.) Token ids are JSON integers, not strings or floats.
Prompt = Annotated[
    Union[StrictStr, Items[StrictInt], Items[StrictStr], Items[Items[StrictInt]]],
    Field(union_mode="left_to_right"),
    batch_bounded("prompts"),
]
# token id -> bias, read by SamplingParams once the entries are known to be at most the
# vocabulary (pydantic would first convert every entry of any size: 0.2 s for 500,000)
LogitBias = Annotated[Any, WithJsonSchema({"type": "object", "additionalProperties": {"type": "number"}})]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _GenerationBody(_Body):
    """A body that samples: ``extra_args`` (the parameters of plugins' sampler stages, by
    namespaced name) also comes under vLLM's name for it, ``vllm_xargs``."""

    @model_validator(mode="before")
    @classmethod
    def _vllm_xargs_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "vllm_xargs" in data and "extra_args" not in data:
            data = {**data, "extra_args": data["vllm_xargs"]}
            del data["vllm_xargs"]
        return data

    # with --scheduling-policy priority: lower runs first (vLLM's extension of the OpenAI API)
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    # with --kv-transfer-config (vLLM's extension): {"do_remote_decode": true} on a prefill
    # server, or the parameters a prefill server returned, on a decode server
    kv_transfer_params: dict[str, Any] | None = None
    # logprobs name tokens as "token_id:N" (None: as --return-tokens-as-token-ids says)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's beam search: n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions``; any ``SamplingParams`` field may be added (``top_k``,
    ``min_p``, ``repetition_penalty``, ``ignore_eos``, ...)."""

    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | Items[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias = None
    seed: int | None = None
    user: str | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    best_of: int | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | Items[ContentPart] | None, context_bounded("content parts")] = None
    name: str | None = None


class ChatCompletionRequest(_GenerationBody):
    """``POST /v1/chat/completions``; any ``SamplingParams`` field may be added."""

    model: str | None = None
    messages: Annotated[Items[ChatMessage], context_bounded("messages")]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Items[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias = None
    seed: int | None = None
    user: str | None = None
    tools: Items[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the reply starts with the last message's content where that message is the reply's role (vLLM)
    chat_template: str | None = None  # with --trust-request-chat-template only
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[Items[ChatMessage], context_bounded("messages")] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Items[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: Annotated[Items[int], context_bounded("token ids")] = Field(default_factory=list)
