"""Host offload: a second tier for the prefix cache (``kv_offload_bytes``).

The full blocks of every request that finishes, and any cached block the device prefix cache
hands out to new contents before it was kept, are copied to host memory (pinned where the
device has it), keyed by their prefix-cache hash and kept least recently used first up to the
budget. A later request whose prefix misses on the device but is held here has those blocks
copied back instead of computed, within the step that admits it.

Both kinds of copy are queued at the start of the step, before the forward, saves first. On
the CPU they are plain copies. On a GPU the saves run on a side stream, beside the forwards
that follow (so a finished request's blocks reach the host while others decode, not when a
later prompt needs the room), and a step that hands out a block whose save is still running
has its stream wait for that save first, layer by layer: a save records an event after each
layer's copies, and a load into such a block waits, before it writes a layer, for that layer's
save alone, so the load's copies to the device run while the save's later layers still go to
the host (the bus carries both ways at once). Loads run on a third stream, beside the step's
forward: each attention layer waits, before it reads the cache, for that layer's loads alone
(``wait_for_layer_load``), so the later layers' copies run while the first layers compute,
and the forward of a step that brings a long prefix back costs little more than the copies.
The host never waits for any of them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sonar.kv_transfer.interface import KVCacheLayout, KVConnector, KVConnectorMetadata, KVConnectorRole, KVTransferConfig

if TYPE_CHECKING:
    import torch

    from sonar.engine.request import Request
    from sonar.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # device memory one layer's copies of a step go through at most


@dataclass(slots=True)
class OffloadMetadata(KVConnectorMetadata):
    """One step's copies, in the order the worker makes them."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    evicted: list[int] = field(default_factory=list)  # cached blocks handed out to new contents this step

    @property
    def has_work(self) -> bool:
        return bool(self.saves or self.loads)


class OffloadingConnector(KVConnector):
    """Evicted prefix-cache blocks kept in host memory, up to
    ``kv_connector_extra_config["kv_offload_bytes"]`` (``--kv-offload-bytes``)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout | None = None) -> None:
        super().__init__(config, role, layout)
        if layout is None:
            raise ValueError("the offloading connector needs the engine's KV-cache layout")
        num_bytes = config.kv_connector_extra_config.get("kv_offload_bytes", 0)
        self.num_host_blocks = num_bytes // layout.bytes_per_block
        if self.num_host_blocks < 1:
            raise ValueError(
                f"kv_offload_bytes={num_bytes} holds no KV block: one block takes {layout.bytes_per_block} bytes "
                f"({layout.block_size} tokens over {layout.num_layers} layers); give at least that"
            )
        # scheduler side: which hash each host slot holds, least recently used first; and the
        # early copies of blocks still on the device (a finished request's), oldest first
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._shadow_of: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._evicted: list[int] = []
        self._pinned: set[int] = set()  # slots this step's loads read: not reused before they run
        self._matched: dict[str, tuple[int, list[int]]] = {}  # request -> (first block, slots found)
        # worker side: one host tensor per layer, [num_host_blocks, 2, block_size, num_kv_heads, head_dim]
        self.host: list[torch.Tensor] = []
        self.kv_caches: list[torch.Tensor] = []
        self._save_stream = None
        self._load_stream = None
        self._load_events: list = []  # this step's loads: an event per layer, recorded after its copies
        self._saves_in_flight: dict[int, list] = {}  # device block -> the per-layer events its save records
        self._save_events: list[tuple[list, list[int]]] = []  # in issue order, pruned once done

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        num_bytes = config.kv_connector_extra_config.get("kv_offload_bytes")
        if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes <= 0:
            raise ValueError(f"the offloading connector needs kv_connector_extra_config['kv_offload_bytes'] > 0, got {num_bytes!r}")

    @property
    def has_pending_work(self) -> bool:
        return bool(self._saves or self._loads)

    @property
    def num_cached_host_blocks(self) -> int:
        """Blocks the host tier holds now (early copies of device blocks among them)."""
        return len(self._slot_of) + len(self._shadow_of)

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False
        block_size = self.layout.block_size
        first = num_computed_tokens // block_size
        slots = []
        for block_hash in request.block_hashes[first : (request.num_tokens - 1) // block_size]:
            slot = self._slot_of.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
            self._slot_of.move_to_end(block_hash)
        if not slots:
            return 0, False
        self._pinned.update(slots)  # the allocation that follows may evict: never into these
        self._matched[request.request_id] = (first, slots)
        return len(slots) * block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first, slots = self._matched.pop(request.request_id, (0, []))
        for index, slot in enumerate(slots[: num_external_tokens // self.layout.block_size]):
            self._loads.append((slot, block_ids[first + index]))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Copy the request's computed full blocks to free host slots early (or over older
        early copies), never over blocks the tier holds for good: a block later handed out on
        the device is then already on the host, and no copy waits in the step that needs it."""
        num_full = min(len(block_ids), len(request.block_hashes), request.num_computed_tokens // self.layout.block_size)
        older_shadows = len(self._shadow_of)
        for block_id, block_hash in zip(block_ids[:num_full], request.block_hashes[:num_full]):
            if block_id < 0 or block_hash in self._slot_of or block_hash in self._shadow_of:
                continue
            if self._free_slots:
                slot = self._free_slots.pop()
            elif older_shadows:
                slot = self._reclaim_shadow()
                older_shadows -= 1
            else:
                break
            if slot is None:
                break
            self._saves.append((block_id, slot))
            self._shadow_of[block_hash] = slot
        return False, None

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        self._evicted.append(block_id)  # its early copy, if still running, must end before new contents
        if block_hash in self._slot_of:  # held already
            self._slot_of.move_to_end(block_hash)
            return
        slot = self._shadow_of.pop(block_hash, None)
        if slot is not None:  # copied early: now the tier holds it for good
            self._slot_of[block_hash] = slot
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._saves.append((block_id, slot))
        self._slot_of[block_hash] = slot

    def _reclaim_shadow(self) -> int | None:
        """The slot of the oldest early copy (its block is still on the device)."""
        for block_hash, slot in self._shadow_of.items():
            if slot not in self._pinned:
                del self._shadow_of[block_hash]
                return slot
        return None

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        slot = self._reclaim_shadow()
        if slot is not None:
            return slot
        for block_hash, slot in self._slot_of.items():  # least recently used first
            if slot not in self._pinned:
                del self._slot_of[block_hash]
                return slot
        return None  # every slot is read this step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        saves: dict[int, int] = {}
        for block_id, slot in self._saves:  # a slot saved twice in one step keeps the later block
            saves.pop(slot, None)
            saves[slot] = block_id
        metadata = OffloadMetadata([(block_id, slot) for slot, block_id in saves.items()], self._loads, self._evicted)
        self._saves, self._loads, self._evicted = [], [], []
        self._pinned.clear()
        self._matched.clear()
        return metadata

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        import torch

        self.kv_caches = kv_caches
        first = kv_caches[0]
        _, _, block_size, num_kv_heads, head_dim = first.shape
        pin = first.device.type == "cuda"
        shape = (self.num_host_blocks, 2, block_size, num_kv_heads, head_dim)
        self.host = [torch.empty(shape, dtype=first.dtype, pin_memory=pin) for _ in kv_caches]
        logger.info("KV offload: %d host blocks (%.1f MiB%s)", self.num_host_blocks,
                    self.num_host_blocks * self.layout.bytes_per_block / 2**20, ", pinned" if pin else "")

    def needs_layer_hooks(self, metadata: KVConnectorMetadata) -> bool:
        """Only a GPU step that loads: its layers wait for their own loads."""
        cuda = bool(self.kv_caches) and self.kv_caches[0].device.type == "cuda"
        return cuda and isinstance(metadata, OffloadMetadata) and bool(metadata.loads)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, OffloadMetadata):
            return
        if self.kv_caches and self.kv_caches[0].device.type == "cuda":
            self._join_loads()  # a step that never reached its forward: its loads land first
            self._save_beside(metadata)  # the loads too
            return
        if metadata.saves:
            self._copy(metadata.saves, to_host=True)
        if metadata.loads:
            self._copy([(block_id, slot) for slot, block_id in metadata.loads], to_host=False)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if layer_idx < len(self._load_events):
            import torch

            torch.cuda.current_stream(self.kv_caches[0].device).wait_event(self._load_events[layer_idx])

    def wait_for_save(self) -> None:
        self._join_loads()  # whatever the forward did not wait for (layers it has no hook in)

    def _join_loads(self) -> None:
        if self._load_events:
            import torch

            torch.cuda.current_stream(self.kv_caches[0].device).wait_event(self._load_events[-1])
            self._load_events = []

    def _save_beside(self, metadata: OffloadMetadata) -> None:
        """Queue the step's saves on the save stream (after what the step's stream holds so
        far: the blocks' contents), then the loads on the load stream (after the same: earlier
        steps' reads and writes of the blocks they fill), each layer's after that layer's
        copies of every still running save of a block handed out this step (this step's saves
        among them); then have the step's stream wait for those saves whole (its forward
        writes the reused blocks too). The step's layers wait for their loads in
        ``wait_for_layer_load``."""
        import torch

        device = self.kv_caches[0].device
        main = torch.cuda.current_stream(device)
        if metadata.saves:
            if self._save_stream is None:
                self._save_stream = torch.cuda.Stream(device)
            side = self._save_stream
            side.wait_stream(main)
            with torch.cuda.stream(side):
                layer_events = self._copy_device(metadata.saves, to_host=True)
            blocks = [block_id for block_id, _ in metadata.saves]
            for block_id in blocks:
                self._saves_in_flight[block_id] = layer_events
            self._save_events.append((layer_events, blocks))
        running: dict[int, list] = {}  # the saves the step's reused blocks wait for, by identity
        for block_id in metadata.evicted:
            layer_events = self._saves_in_flight.pop(block_id, None)
            if layer_events is not None:
                running[id(layer_events)] = layer_events
        if metadata.loads:
            if self._load_stream is None:
                self._load_stream = torch.cuda.Stream(device)
            load = self._load_stream
            load.wait_stream(main)
            with torch.cuda.stream(load):
                pairs = [(block_id, slot) for slot, block_id in metadata.loads]
                self._load_events = self._copy_device(pairs, False, list(running.values()))
        for layer_events in running.values():
            main.wait_event(layer_events[-1])
        while self._save_events and self._save_events[0][0][-1].query():  # finished: nothing to wait for
            layer_events, blocks = self._save_events.pop(0)
            for block_id in blocks:
                if self._saves_in_flight.get(block_id) is layer_events:
                    del self._saves_in_flight[block_id]

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy each ``(device block, host slot)`` pair of every layer, one way."""
        import torch

        device = self.kv_caches[0].device
        if device.type == "cpu":
            block_ids = torch.tensor([b for b, _ in pairs], dtype=torch.int64)
            slots = torch.tensor([s for _, s in pairs], dtype=torch.int64)
            for kv, host in zip(self.kv_caches, self.host):
                if to_host:  # [2, n, ...] -> [n, 2, ...]
                    host.index_copy_(0, slots, kv.index_select(1, block_ids).transpose(0, 1))
                else:
                    kv.index_copy_(1, block_ids, host.index_select(0, slots).transpose(0, 1))
            return
        self._copy_device(pairs, to_host)

    def _copy_device(self, pairs: list[tuple[int, int]], to_host: bool, wait_for: list[list] | None = None) -> list:
        """The same on a GPU, queued on the current stream with the host not waiting: per
        layer, one gather or scatter on the device through a staging tensor, and one host copy
        per run of consecutive host slots (evicted blocks take slots in order, so a prefix's
        blocks are a few long runs): a few large copies at the bus's speed, not one small copy
        per block and layer. Returns an event per layer, recorded after that layer's last
        copy; a load first waits, before it writes layer ``i``, for event ``i`` of each of
        ``wait_for`` (saves still reading the blocks it fills)."""
        import torch

        device = self.kv_caches[0].device
        cuda = device.type == "cuda"
        stream = torch.cuda.current_stream(device) if cuda else None
        pairs = sorted(pairs, key=lambda pair: pair[1])
        per_block = self.host[0][0].numel() * self.host[0].element_size()
        chunk = max(1, STAGING_BYTES // per_block)
        layer_events = [torch.cuda.Event() for _ in self.kv_caches] if cuda else []
        for start in range(0, len(pairs), chunk):
            part = pairs[start : start + chunk]
            block_ids = torch.tensor([b for b, _ in part], dtype=torch.int64).to(device, non_blocking=True)
            runs = slot_runs([s for _, s in part])
            for layer, (kv, host) in enumerate(zip(self.kv_caches, self.host)):
                if to_host:  # [2, n, ...] -> [n, 2, ...], then each run to its slots
                    staged = kv.index_select(1, block_ids).transpose(0, 1).contiguous()
                    for first, slot, count in runs:
                        host[slot : slot + count].copy_(staged[first : first + count], non_blocking=True)
                else:
                    staged = torch.empty((len(part), *host.shape[1:]), dtype=host.dtype, device=device)
                    for first, slot, count in runs:
                        staged[first : first + count].copy_(host[slot : slot + count], non_blocking=True)
                    for save_events in wait_for or ():  # this layer of the blocks read to the host first
                        stream.wait_event(save_events[layer])
                    kv.index_copy_(1, block_ids, staged.transpose(0, 1))
                if cuda:
                    layer_events[layer].record(stream)
        return layer_events


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(index of its first pair, first slot, length)`` of each run of consecutive slots in
    ``slots`` (sorted)."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, slot, 1))
    return runs
