"""The worker's adapters: those it knows, an LRU of them read into host memory, and the
``max_loras`` device slots a step's adapters are copied into."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from sonar.lora.adapter import LoRAAdapter, LoRATarget, load_adapter
from sonar.lora.errors import LoRAError
from sonar.lora.layers import LoRABatch, LoRASite, attach_lora
from sonar.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters of one model on one device.

    :param model: the loaded base model; every linear layer gets adapter slots.
    :param max_loras: device slots: the most distinct adapters one step may use.
    :param max_lora_rank: the rank every slot is padded to (an adapter may have less).
    :param max_cpu_loras: adapters kept read in host memory (least recently used dropped,
        read again from their folder when a request needs them).
    :param max_tokens: the most tokens (rows, with graph padding) a step runs.
    """

    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int, max_tokens: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.batch = LoRABatch(max_tokens, device)
        self.sites: dict[str, LoRASite] = attach_lora(model, self.batch, max_loras, max_lora_rank, dtype)
        self.targets: dict[str, LoRATarget] = {name: site.target for name, site in self.sites.items()}
        # modules the checkpoint fuses and the model splits (an adapter on one is split too)
        self.fused_modules: dict[str, tuple[str, ...]] = dict(getattr(model, "lora_fused_modules", {}))
        self.layers = list({id(site.layer): site.layer for site in self.sites.values()}.values())
        self.known: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU: most recent last
        self.num_activations = 0  # adapters copied into a slot so far

    # -- adapters ------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Read and check ``request``'s adapter and keep it in host memory; False if this very
        adapter is already known.

        :raises LoRAError: the adapter cannot be served, or its id names another adapter.
        """
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise LoRAError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} ({known.lora_path})")
            return False
        adapter = load_adapter(request, self.targets, self.max_lora_rank, self.dtype, self.fused_modules)
        self.known[request.lora_int_id] = request
        self._keep_in_host(adapter)
        logger.info(
            "loaded LoRA adapter %r (id %d): rank %d, %d modules, %.1f MiB",
            request.lora_name, request.lora_int_id, adapter.rank, len(adapter.modules), adapter.num_bytes / 2**20,
        )
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is freed); False if it was not known."""
        if self.known.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers:
                layer.clear_slot(slot)
        return True

    def list_ids(self) -> set[int]:
        return set(self.known)

    def _keep_in_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.request.lora_int_id] = adapter
        self.host.move_to_end(adapter.request.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    # -- one step ------------------------------------------------------------------------

    def prepare_step(self, lora_ids: list[int], num_scheduled: list[int]) -> None:
        """Put the step's adapters into slots and write each token's slot: ``lora_ids`` (0:
        none) and ``num_scheduled`` per request, in the order the batch lays out its tokens.
        A step without adapters turns the LoRA path off."""
        needed = {i for i in lora_ids if i}
        if not needed:
            self.batch.deactivate()
            return
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} adapters, more than max_loras={self.max_loras} slots")
        for lora_int_id in needed:
            self._activate(lora_int_id, needed)
        slots = np.fromiter((self.slot_of[i] if i else -1 for i in lora_ids), dtype=np.int32, count=len(lora_ids))
        self.batch.set(np.repeat(slots, num_scheduled))

    def _activate(self, lora_int_id: int, needed: set[int]) -> None:
        if lora_int_id in self.slot_of:
            self.slot_of.move_to_end(lora_int_id)
            return
        request = self.known.get(lora_int_id)
        if request is None:
            raise LoRAError(f"no LoRA adapter with lora_int_id {lora_int_id} was added")
        free = set(range(self.max_loras)) - set(self.slot_of.values())
        if free:
            slot = min(free)
        else:  # the least recently used slot this step does not need
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        adapter = self.host.get(lora_int_id)
        if adapter is None:  # dropped from host memory: read again
            adapter = load_adapter(request, self.targets, self.max_lora_rank, self.dtype, self.fused_modules)
        self._keep_in_host(adapter)
        for layer in self.layers:
            layer.clear_slot(slot)
        for name, weights in adapter.modules.items():
            site = self.sites[name]
            site.layer.set_part(slot, site.part, *site.cut(weights.a, weights.b))
        self.slot_of[lora_int_id] = slot
        self.num_activations += 1
