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

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


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
    :param kv_ip: the address a connector that serves KV listens on (and advertises).
    :param kv_port: its port; 0: a free port, advertised in the ``kv_transfer_params`` it
        hands out.
    :param kv_connector_extra_config: connector-specific options, passed through.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config['kv_connector'] must name a connector, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config['kv_port'] must be a port number (0: a free one), got {self.kv_port!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config['kv_connector_extra_config'] must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: KVTransferConfig | dict[str, Any]) -> KVTransferConfig:
        """A config from vLLM's dictionary (``{"kv_connector": "SonarConnector", "kv_role":
        "kv_producer"}``).

        :raises ValueError: not a dictionary, an unknown key, or a field of the wrong type.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
        if "kv_connector" not in value:
            raise ValueError('kv_transfer_config needs a "kv_connector" (e.g. "SonarConnector")')
        for name in ("kv_role", "engine_id", "kv_ip"):
            if name in value and value[name] is not None and not isinstance(value[name], str):
                raise ValueError(f"kv_transfer_config[{name!r}] must be a string, got {value[name]!r}")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What a connector needs to know of the engine's KV cache, and what two engines that
    exchange blocks must agree on (each layer's cache is
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``)."""

    model: str  # the model's name (its file or folder name) and architecture
    dtype: str  # the cache's torch dtype name
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # device blocks of this engine (not compared between engines)
    tensor_parallel_size: int = 1

    @property
    def element_size(self) -> int:
        import torch

        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer (keys and values)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    def mismatches(self, other: KVCacheLayout) -> list[str]:
        """What differs from ``other`` among what two engines exchanging blocks must share."""
        names = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size")
        return [f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}" for name in names if getattr(self, name) != getattr(other, name)]


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step; a connector subclasses it
    with its own plain fields (it travels with the ``SchedulerOutput``, so nothing in it may
    need pickling: ids, block numbers, addresses)."""

    @property
    def has_work(self) -> bool:
        """Whether the worker half has anything to do for it (a step that schedules no tokens
        still runs the worker when it does)."""
        return False


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports after a step: requests whose asynchronous sends and
    loads completed, and those among the loads that failed (recomputed instead)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnector:
    """Moves KV blocks in and out of one engine. Subclass it and register the subclass; an
    instance serves one ``role``, and only that role's methods are called on it.

    Scheduler side, in the order the scheduler calls them for a waiting request:
    ``get_num_new_matched_tokens`` (after the local prefix-cache lookup),
    ``update_state_after_alloc`` (once its blocks are allocated), then once per step
    ``build_connector_meta``, and ``request_finished`` when it ends. ``on_block_evicted``
    hears of every prefix-cached block the cache hands out to new contents (before they are
    written). ``set_handshake_metadata`` receives what the worker half published.

    Worker side, around each forward: ``start_load_kv`` before it, ``wait_for_layer_load``
    in each attention layer before it reads the cache, ``save_kv_layer`` after each layer
    writes it, ``wait_for_save`` after the forward, and ``get_finished`` /
    ``get_failed_loads`` to report transfers that completed asynchronously.
    ``get_handshake_metadata`` publishes, once the cache exists, what the scheduler half
    needs of it (an address it serves blocks on).

    :param config: the transfer configuration.
    :param role: which half this instance is.
    :param layout: the engine's KV cache (the engine always passes it).
    """

    #: the per-layer hooks do work (a CUDA runner then runs the forward eagerly, not as graphs)
    uses_layer_hooks = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout | None = None) -> None:
        self.config = config
        self.role = role
        self.layout = layout

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Refuse, with a ValueError saying why, a configuration this connector cannot serve
        (called when the engine's options are resolved, before anything loads)."""

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after the first ``num_computed_tokens`` (found locally) exist
        outside and can be loaded, and whether they load asynchronously (the request then
        waits, holding its blocks, until ``get_finished`` reports it)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks are allocated: remember where its ``num_external_tokens``
        loaded tokens go (``block_ids``: every block of the request, in order)."""

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """The prefix cache is about to reuse block ``block_id``, which held the full block
        of hash ``block_hash``; its contents are intact until this step's forward."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and saves, for the worker half (resets what it accumulated)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended. Returns whether its blocks must stay allocated until a save
        finishes (freed once ``get_finished`` reports it), and transfer parameters to return
        to the client (a disaggregated prefill tells the decode engine where the KV is)."""
        return False, None

    @property
    def has_pending_work(self) -> bool:
        """Whether copies are queued for the next step's metadata that no request waits for
        (an idle engine steps once more to hand them to the worker)."""
        return False

    def set_handshake_metadata(self, metadata: dict[str, Any] | None) -> None:
        """What the worker half's ``get_handshake_metadata`` returned (plain data)."""

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The worker's KV-cache tensors, one per layer, once they are allocated."""

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        """Plain data for the scheduler half (an address), once the caches are registered."""
        return None

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin loading this step's external blocks into the cache (may return early)."""

    def needs_layer_hooks(self, metadata: KVConnectorMetadata) -> bool:
        """Whether this step's forward must call the per-layer hooks (``wait_for_layer_load``,
        ``save_kv_layer``): ``uses_layer_hooks`` by default. A connector whose hooks do work
        on some steps only (loads that land layer by layer) answers per step; a step replayed
        from a CUDA graph then calls ``wait_for_layer_load`` for every layer before the replay,
        and ``save_kv_layer`` not at all (connectors that save per layer set
        ``uses_layer_hooks``, which turns the graphs off)."""
        return self.uses_layer_hooks

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s loads of this step are in the cache (on a GPU it
        may instead order the device's work: the current stream waits for them)."""

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        """Layer ``layer_idx`` wrote this step's keys and values: start saving the blocks the
        metadata names."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the cache's current contents."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous saves and loads completed since the last call:
        ``(done_sending, done_receiving)`` (a failed load counts as done receiving, and is
        also reported by ``get_failed_loads``)."""
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        """Requests among those done receiving whose load failed since the last call: their
        external tokens are computed instead."""
        return set()

    def shutdown(self) -> None:
        """Stop whatever threads or sockets the connector runs."""
