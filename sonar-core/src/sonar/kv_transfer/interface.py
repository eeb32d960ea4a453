"""The KV connector interface and its data types."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sonar.attention import AttentionMetadata
    from sonar.engine.request import Request
    from sonar.engine.scheduler_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: each engine core builds one of each."""

    SCHEDULER = "scheduler"  # in the engine core, next to the scheduler
    WORKER = "worker"  # in every worker, next to the KV cache


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """``kv_transfer_config`` as users give it (vLLM's keys).

    :param kv_connector: the registered connector.
    :param kv_role: ``"kv_producer"`` (computes KV and sends it), ``"kv_consumer"`` (receives
        it instead of computing), or ``"kv_both"``.
    :param engine_id: this engine's name among its peers (default: generated).
    :param kv_connector_extra_config: connector-specific options, passed through.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}")


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step; a connector subclasses it
    with its own plain fields (it travels with the ``SchedulerOutput``, so nothing in it may
    need pickling: ids, block numbers, addresses)."""


class KVConnector:
    """Moves KV blocks in and out of one engine. Subclass it and register the subclass; an
    instance serves one ``role``, and only that role's methods are called on it.

    Scheduler side, in the order the scheduler calls them for a waiting request:
    ``get_num_new_matched_tokens`` (after the local prefix-cache lookup),
    ``update_state_after_alloc`` (once its blocks are allocated), then once per step
    ``build_connector_meta``, and ``request_finished`` when it ends.

    Worker side, around each forward: ``start_load_kv`` before it, ``wait_for_layer_load``
    in each attention layer before it reads the cache, ``save_kv_layer`` after each layer
    writes it, ``wait_for_save`` after the forward, and ``get_finished`` to report transfers
    that completed asynchronously.

    :param config: the transfer configuration.
    :param role: which half this instance is.
    """

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after the first ``num_computed_tokens`` (found locally) exist
        outside and can be loaded, and whether they load asynchronously (the request then
        waits, holding its blocks, until ``get_finished`` reports it)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks are allocated: remember where its ``num_external_tokens``
        loaded tokens go."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and saves, for the worker half (resets what it accumulated)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended. Returns whether its blocks must stay allocated until a save
        finishes (freed once ``get_finished`` reports it), and transfer parameters to return
        to the client (a disaggregated prefill tells the decode engine where the KV is)."""
        return False, None

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The worker's KV-cache tensors, one per layer, once they are allocated."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin loading this step's external blocks into the cache (may return early)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s loads of this step are in the cache."""

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Layer ``layer_idx`` wrote this step's keys and values: start saving the blocks the
        metadata names."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the cache's current contents."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous saves and loads completed since the last call:
        ``(done_sending, done_receiving)``."""
        return set(), set()
