"""What each attention layer of a model keeps in the KV cache, as the model declares it.

A model lists one spec per layer (``kv_cache_specs()``, see ``sonar.model_interface``); the
KV-cache manager reads from them which cached positions a request can still need, and gives
back the blocks that no layer will read again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's use of the KV cache. Subclasses say which cached positions stay needed."""

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """The earliest position that any query at ``num_computed_tokens`` or later reads in
        this layer: every position before it may be dropped from the cache."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal attention over the whole context: every cached position stays needed."""

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """Always 0: a full-attention layer reads the whole context."""
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    """Attention over the last ``sliding_window`` positions, the query's own included: the
    query at position ``p`` reads positions ``p - sliding_window + 1`` to ``p``."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1")

    def first_needed_position(self, num_computed_tokens: int) -> int:
        """``num_computed_tokens - sliding_window + 1`` (never below 0): the window start of the
        next query, which is the earliest of every later query's."""
        return max(0, num_computed_tokens - self.sliding_window + 1)
