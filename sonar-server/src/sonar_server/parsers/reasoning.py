"""Built-in reasoning parsers: the ``<think>…</think>`` family."""

from __future__ import annotations

from sonar_server.parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ-style models): reasoning is a ``<think>…</think>`` block at the start of
    the output; an output without one is all answer. An unclosed block is all reasoning."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the chat template opens ``<think>``, so the output starts inside the
    reasoning (a repeated ``<think>`` is dropped) and the answer follows ``</think>``."""

    name = "deepseek_r1"
    starts_in_reasoning = True
