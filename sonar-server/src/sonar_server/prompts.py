"""Tokenization and chat templates, off the event loop and the engine thread, done the way the
offline ``LLM`` does them so the same prompt gives the same tokens."""

from __future__ import annotations

import asyncio
from typing import Any

from sonar_server.errors import ApiError
from sonar_server.state import ServerState

# apply_chat_template's own arguments and the template's message list: the renderer sets them,
# so template variables a request sends (chat_template_kwargs) may not
_RENDERER_ARGUMENTS = frozenset({
    "conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


async def encode_prompt(state: ServerState, text: str) -> list[int]:
    """Token ids of a completion prompt, as ``LLM.generate`` would tokenize it."""
    state.require_tokenizer()
    return await asyncio.to_thread(state.client.encode, text)


async def render_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied to ``messages``: the prompt text and its token ids, as
    ``LLM.chat`` builds them."""
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
        return text, tokenizer.encode(text, add_special_tokens=False)

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
