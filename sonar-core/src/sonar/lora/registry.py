"""The engine core's adapters: the source of truth every frontend reads them from."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sonar.lora.errors import LoRAError, LoRAInUseError
from sonar.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    """Which adapters an engine core serves, by id.

    Adding one reads and checks it through ``load`` (the workers keep it); removing one that
    running or waiting requests use (``num_requests_of``) only marks it: it is no longer
    listed and takes no new requests, and is dropped (``unload``) once its last request ends,
    so a removal never breaks a request. ``version`` changes with every change of the listed
    set, so a frontend knows when to read it again.

    :param enabled: whether the engine was started with ``enable_lora``.
    """

    def __init__(
        self, enabled: bool, load: Callable[[LoRARequest], None], unload: Callable[[int], None], num_requests_of: Callable[[int], int]
    ) -> None:
        self.enabled = enabled
        self._load = load
        self._unload = unload
        self._num_requests_of = num_requests_of
        self.adapters: dict[int, LoRARequest] = {}
        self.removing: set[int] = set()  # marked removed; dropped once no request uses them
        self.version = 0
        self._removed: list[int] = []  # dropped since the last ``pop_removed``

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")

    def add(self, request: LoRARequest) -> bool:
        """Serve ``request``'s adapter; False where this very adapter is served already.

        :raises LoRAError: LoRA is off, the adapter cannot be served, or its name or id is
            another adapter's.
        :raises LoRAInUseError: its id is being removed (its requests still run).
        """
        self._check_enabled()
        lora_int_id = request.lora_int_id
        if lora_int_id in self.removing:
            raise LoRAInUseError(f"LoRA adapter {request.lora_name!r} (id {lora_int_id}) is being removed; add it again once its requests finish")
        known = self.adapters.get(lora_int_id)
        if known is not None:
            if known == request:
                return False
            raise LoRAError(f"lora_int_id {lora_int_id} already names adapter {known.lora_name!r} ({known.lora_path})")
        for other in self.adapters.values():
            if other.lora_name == request.lora_name:
                raise LoRAError(f"an adapter named {request.lora_name!r} is already served (id {other.lora_int_id})")
        self._load(request)
        self.adapters[lora_int_id] = request
        self.version += 1
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Stop serving an adapter: at once where no request uses it, else once its requests
        have finished. False where it is not served (or already being removed)."""
        if lora_int_id not in self.adapters or lora_int_id in self.removing:
            return False
        self.removing.add(lora_int_id)
        self.version += 1
        self.finish_removals()
        return True

    def check_request(self, lora_request: LoRARequest | None) -> None:
        """Refuse a request whose adapter is not served as it names it (frontends add an
        adapter before its first request; one removed meanwhile is not brought back).

        :raises LoRAInUseError: the adapter is being removed.
        :raises LoRAError: it is not served, or its id is another adapter's.
        """
        if lora_request is None:
            return
        self._check_enabled()
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self.removing:
            raise LoRAInUseError(f"LoRA adapter {lora_request.lora_name!r} (id {lora_int_id}) is being removed and takes no new requests")
        served = self.adapters.get(lora_int_id)
        if served is None:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} (id {lora_int_id}) is not served: add it first")
        if served != lora_request:
            raise LoRAError(f"lora_int_id {lora_int_id} names adapter {served.lora_name!r} ({served.lora_path}), not {lora_request.lora_name!r}")

    def finish_removals(self) -> None:
        """Drop the adapters marked removed that no request uses any more."""
        for lora_int_id in [i for i in self.removing if not self._num_requests_of(i)]:
            self.removing.discard(lora_int_id)
            request = self.adapters.pop(lora_int_id)
            self._unload(lora_int_id)
            self._removed.append(lora_int_id)
            logger.info("removed LoRA adapter %r (id %d)", request.lora_name, lora_int_id)

    def pop_removed(self) -> list[int]:
        """The ids dropped since the last call."""
        removed, self._removed = self._removed, []
        return removed

    def listed(self) -> list[LoRARequest]:
        """The adapters served (those being removed left out), by id."""
        return [self.adapters[i] for i in sorted(self.adapters) if i not in self.removing]
