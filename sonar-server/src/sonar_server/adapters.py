"""The LoRA adapters one API server serves, by the names clients send in ``model``.

The engine cores hold the loaded set (``list_loras``), so every API server and every
data-parallel replica agrees on it. An engine core answers a list call between two steps, so
asking on every request would add a step to each adapter request's first token. The only API
server of its engines therefore keeps the last list and asks again when the engines'
``lora_registry_version`` (in their stats) has moved, when a name is not in it, and after its
own loads and unloads. One of several API servers asks on every request: another one's unload
reaches its stats only with the next heartbeat, and an engine core given a request for an
adapter it no longer serves loads that adapter again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from sonar.lora import LoRAError, LoRAInUseError, LoRARequest

from sonar_server.errors import ApiError
from sonar_server.lora import LoRAPathError, check_adapter_name, confine_adapter_path
from sonar_server.settings import ServerSettings

logger = logging.getLogger("sonar_server")

STARTUP_WAIT_S = 600.0  # how long an API server other than the first waits for --lora-modules


class ServedAdapters:
    """Adapter lookup, listing and runtime loading for one API server.

    :param client: the engine client (``AsyncLLM`` or ``AsyncMPLLM``).
    :param settings: the server's settings (``lora_modules``, ``lora_root``, served names).
    :param server_index: this API server's index among ``settings.api_server_count``; adapter
        ids it hands out are its own residue class, so two API servers never issue one id.
    """

    def __init__(self, client: Any, settings: ServerSettings, server_index: int = 0) -> None:
        self.client = client
        self.settings = settings
        self.server_index = server_index
        self.enabled = bool(getattr(getattr(client, "model_config", None), "enable_lora", False))
        self._parents = {m.name: m.base_model_name for m in settings.lora_modules if m.base_model_name}
        # ids: --lora-modules take 1..N in order; runtime loads are never given an id twice
        self._next_id = len(settings.lora_modules) + 1 + server_index
        self._lock = asyncio.Lock()
        self._known: dict[str, LoRARequest] | None = None  # the last list, by name
        self._known_version: Any = None

    # -- lookup --------------------------------------------------------------------------

    async def loaded(self) -> list[LoRARequest]:
        """Every adapter the engine cores hold now (asked of them)."""
        if not self.enabled:
            return []
        version = self._registry_version()
        adapters = list(await self.client.list_loras())
        self._known, self._known_version = {a.lora_name: a for a in adapters}, version
        return adapters

    def _registry_version(self) -> Any:
        return getattr(self.client.get_stats(), "lora_registry_version", None)

    async def _lookup(self, name: str) -> LoRARequest | None:
        known = self._known
        version = self._registry_version()
        alone = self.settings.api_server_count == 1
        if alone and known is not None and version is not None and version == self._known_version and name in known:
            return known[name]
        return next((a for a in await self.loaded() if a.lora_name == name), None)

    async def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name).

        :raises ApiError: 404 when ``name`` is neither a served model name nor an adapter.
        """
        if name is None or name in self.settings.served_model_names:
            return None
        if self.enabled:
            adapter = await self._lookup(name)
            if adapter is not None:
                return adapter
        adapters = list((self._known or {}).values())
        served = ", ".join(repr(n) for n in [*self.settings.served_model_names, *(a.lora_name for a in adapters[:20])])
        more = f" and {len(adapters) - 20} more adapters" if len(adapters) > 20 else ""
        shown = name if len(name) <= 200 else name[:200] + "..."
        raise ApiError(404, f"model {shown!r} is not served here; this server serves {served}{more} (GET /v1/models lists them)", param="model")

    def parent(self, adapter: LoRARequest) -> str:
        """The served model an adapter is listed under in ``/v1/models``."""
        return self._parents.get(adapter.lora_name) or self.settings.model_name

    async def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the loaded adapters, as vLLM lists them."""
        return [
            {
                "id": adapter.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "sonar",
                "root": adapter.lora_path,
                "parent": self.parent(adapter),
                "max_model_len": max_model_len,
            }
            for adapter in await self.loaded()
        ]

    # -- start-up ------------------------------------------------------------------------

    async def load_startup(self) -> None:
        """Load ``--lora-modules`` (the first API server) or wait until they are loaded (the
        others), before the server answers. A bad adapter raises ValueError naming it."""
        modules = self.settings.lora_modules
        if not modules:
            return
        if self.server_index != 0:
            await self._wait_for({m.name for m in modules})
            return
        for number, module in enumerate(modules, start=1):
            adapter = LoRARequest(module.name, number, os.path.abspath(module.path))
            started = time.monotonic()
            try:
                await self.client.add_lora(adapter)
            except LoRAError as exc:
                raise ValueError(f"--lora-modules {module.name!r}: {exc}") from None
            logger.info("loaded LoRA adapter %r from %s in %.2fs", module.name, module.path, time.monotonic() - started)

    async def _wait_for(self, names: set[str]) -> None:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while not names <= {a.lora_name for a in await self.loaded()}:
            if time.monotonic() > deadline:
                raise ValueError(f"--lora-modules {sorted(names)} were not loaded within {STARTUP_WAIT_S:.0f}s")
            await asyncio.sleep(0.2)

    # -- runtime loading -----------------------------------------------------------------

    async def load(self, name: Any, path: Any) -> LoRARequest:
        """Load the adapter in folder ``path`` (under ``--lora-root``) as ``name``.

        :raises ApiError: 400 for a refused name or path, a name already in use, or an adapter
            the engine rejects (its message says which field).
        """
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        root = self.settings.lora_root
        assert root is not None  # settings check it when runtime updating is on
        try:
            real_path = await asyncio.to_thread(confine_adapter_path, root, path)
        except LoRAPathError as exc:
            raise ApiError(400, str(exc), param="lora_path") from None
        if name in self.settings.served_model_names:
            raise ApiError(400, f"{name!r} is the served model's name; give the adapter another name", param="lora_name")
        async with self._lock:
            if any(a.lora_name == name for a in await self.loaded()):
                raise ApiError(400, f"an adapter named {name!r} is already loaded; unload it first or pick another name", param="lora_name")
            adapter = LoRARequest(name, self._next_id, real_path)
            self._next_id += self.settings.api_server_count
            try:
                await self.client.add_lora(adapter)
            except LoRAError as exc:
                raise ApiError(400, _relative_to(root, str(exc)), param="lora_path") from None
            finally:
                self._known = None
        logger.info("loaded LoRA adapter %r (id %d) from %s", name, adapter.lora_int_id, real_path)
        return adapter

    async def unload(self, name: Any, lora_int_id: int | None = None) -> LoRARequest:
        """Unload the adapter called ``name`` (whose id, when given, must be ``lora_int_id``).
        New requests for it are refused at once; this returns once the engines have dropped
        it, after the requests that were using it have finished.

        :raises ApiError: 404 when no adapter has that name (and id); 409 when the engine
            refuses because it is in use.
        """
        if not isinstance(name, str):
            raise ApiError(400, f"lora_name must be a string, got {type(name).__name__}", param="lora_name")
        adapter = next((a for a in await self.loaded() if a.lora_name == name and lora_int_id in (None, a.lora_int_id)), None)
        shown = name if len(name) <= 200 else name[:200] + "..."
        if adapter is None:
            raise ApiError(404, f"no LoRA adapter named {shown!r} is loaded", param="lora_name")
        self._known = None
        try:
            await self.client.remove_lora(adapter.lora_int_id)
        except LoRAInUseError as exc:
            raise ApiError(409, f"LoRA adapter {shown!r} is in use: {exc}", param="lora_name") from None
        except LoRAError:  # unloaded meanwhile (by another API server)
            raise ApiError(404, f"no LoRA adapter named {shown!r} is loaded", param="lora_name") from None
        finally:
            self._known = None
        logger.info("unloaded LoRA adapter %r (id %d)", name, adapter.lora_int_id)
        return adapter


def _relative_to(root: str, message: str) -> str:
    """``message`` with paths under ``root`` made relative to it: a client is not told where
    on the host the adapters are kept."""
    return message.replace(root.rstrip(os.sep) + os.sep, "").replace(root, "--lora-root")
