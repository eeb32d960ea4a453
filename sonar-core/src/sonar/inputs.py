"""The prompt forms ``LLM.generate`` and ``AsyncLLM.generate`` take besides a plain string
(vLLM's ``TextPrompt`` and ``TokensPrompt``): plain dicts, typed for readers and checkers."""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (``prompt``: its text, where the caller has it, for outputs)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]

