"""Anthropic Messages request bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict

from sonar_server.list_limits import Items, context_bounded


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Annotated[str | Items[ContentBlock], context_bounded("content blocks")]


class MessagesRequest(_Body):
    """``POST /v1/messages``; any ``SamplingParams`` field may be added as an extra field."""

    model: str
    messages: Annotated[Items[Message], context_bounded("messages")]
    max_tokens: int
    system: Annotated[str | Items[ContentBlock] | None, context_bounded("content blocks")] = None
    stop_sequences: Items[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: Items[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``."""

    model: str
    messages: Annotated[Items[Message], context_bounded("messages")]
    system: Annotated[str | Items[ContentBlock] | None, context_bounded("content blocks")] = None
    tools: Items[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
