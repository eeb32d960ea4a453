"""Tokenization and chat templates, off the event loop and the engine thread, done the way the
offline ``LLM`` does them so the same prompt gives the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sonar_server.errors import ApiError
from sonar_server.state import ServerState

# apply_chat_template's own arguments and the template's message list: the renderer sets them,
# so template variables a request sends (chat_template_kwargs) may not
_RENDERER_ARGUMENTS = frozenset({
    "conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


#: tokens a huge prompt's head may hold past the context before the prompt counts as too long
#: (the cut may split a token); its head is this many characters a token of the context
HEAD_SLACK_TOKENS = 64
HEAD_CHARS_PER_TOKEN = 16


def encode_within_context(encode: Callable[[str], list[int]], text: str, max_model_len: int, param: str) -> list[int]:
    """``encode(text)``, except that a text of far more characters than the context holds tokens
    has its head tokenized first: where the head alone is past the context, the prompt cannot
    be served and a 400 says so before the rest is tokenized (a prompt of megabytes took the
    server seconds of a core to tokenize only to be refused)."""
    head = HEAD_CHARS_PER_TOKEN * (max_model_len + HEAD_SLACK_TOKENS)
    if len(text) > 2 * head:
        count = len(encode(text[:head]))
        if count > max_model_len + HEAD_SLACK_TOKENS:
            raise ApiError(
                400, f"the prompt is more than {max_model_len} tokens (its first {head} characters alone are {count}), "
                f"the model's context is {max_model_len} tokens: no room to generate", param=param,
            )  # fmt: skip
    return encode(text)


async def encode_prompt(state: ServerState, text: str, for_generation: bool = False) -> list[int]:
    """Token ids of a completion prompt, as ``LLM.generate`` would tokenize it; ``for_generation``:
    a prompt whose head alone is past the model's context is refused without tokenizing the rest
    (``encode_within_context``; counting and Kobold's trimming read every token)."""
    state.require_tokenizer()
    if for_generation:
        return await asyncio.to_thread(encode_within_context, state.client.encode, text, state.max_model_len, "prompt")
    return await asyncio.to_thread(state.client.encode, text)


async def render_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    for_generation: bool = False,
) -> tuple[str, list[int]]:
    """The chat template applied to ``messages``: the prompt text and its token ids, as
    ``LLM.chat`` builds them; ``for_generation``: a rendered prompt whose head alone is past the
    model's context is refused without tokenizing the rest (``encode_within_context``)."""
    tokenizer = state.require_tokenizer()
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if len(messages) > state.max_model_len:  # each turn renders to a token at least: refused before the template runs
        raise ApiError(400, f"{len(messages)} messages cannot fit in the model's context of {state.max_model_len} tokens", param="messages")
    reserved = sorted(_RENDERER_ARGUMENTS.intersection(template_kwargs or {}))
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server renders the prompt with its own "
            "(add_generation_prompt and continue_final_message are fields of the request)", param="chat_template_kwargs",
        )
    if "chat_template" in (template_kwargs or {}) and not state.settings.trust_request_chat_template:
        raise ApiError(
            400, "this server does not run chat templates sent with requests (the operator may allow them with --trust-request-chat-template)",
            param="chat_template",
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use the completions API instead")

    def render() -> tuple[str, list[int]]:
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja raises its own error types for bad conversations
            raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        def encode(piece: str) -> list[int]:
            return tokenizer.encode(piece, add_special_tokens=False)

        return text, encode_within_context(encode, text, state.max_model_len, "messages") if for_generation else encode(text)

    return await asyncio.to_thread(render)


async def decode_tokens(state: ServerState, token_ids: list[int]) -> str:
    """The text of ``token_ids``, each checked against the vocabulary first; both off the event loop."""
    tokenizer = state.require_tokenizer()

    def decode() -> str:
        vocab = len(tokenizer)
        for token_id in token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise ApiError(400, f"token id {token_id!r} is outside the vocabulary of {vocab}", param="tokens")
        return tokenizer.decode(token_ids)

    return await asyncio.to_thread(decode)
