"""Anthropic Messages request bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class MessagesRequest(_Body):
    """``POST /v1/messages``; any ``SamplingParams`` field may be added as an extra field."""

    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``."""

    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
