"""Plugin discovery: stevedore entry points (group ``sonar.plugins``) → one pluggy PluginManager."""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from sonar import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sonar.plugins"


@dataclass(slots=True)
class PluginReport:
    loaded: dict[str, str] = field(default_factory=dict)  # entry-point name -> module
    failed: dict[str, str] = field(default_factory=dict)  # entry-point name -> error
    skipped: list[str] = field(default_factory=list)  # not in SONAR_PLUGINS


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_report = PluginReport()


def _allowlist() -> set[str] | None:
    raw = os.environ.get("SONAR_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _on_load_failure(manager: Any, entry_point: Any, exc: BaseException) -> None:
    message = f"{type(exc).__name__}: {exc}"
    _report.failed[entry_point.name] = message
    logger.warning("sonar plugin %r failed to load and was skipped: %s", entry_point.name, message)
    logger.debug("".join(traceback.format_exception(exc)))


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide PluginManager, loading entry-point plugins on first use."""
    global _manager
    with _lock:
        if _manager is not None:
            return _manager
        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        manager.hook.sonar_add_hookspecs.call_historic(kwargs={"manager": manager})  # each plugin adds its own specs as it registers
        from sonar import plugin as core_plugin

        manager.register(core_plugin, name="sonar-core")  # the engine's own parts, whatever SONAR_PLUGINS says
        _load_entry_points(manager)
        _manager = manager
        return manager


def _load_entry_points(manager: pluggy.PluginManager) -> None:
    from importlib.metadata import entry_points

    from stevedore import ExtensionManager, NamedExtensionManager

    allow = _allowlist()
    options = dict(namespace=ENTRY_POINT_GROUP, invoke_on_load=False, on_load_failure_callback=_on_load_failure)
    if allow is None:
        extensions = ExtensionManager(**options)
    else:
        # only the listed plugins are imported at all
        available = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
        _report.skipped.extend(sorted(available - allow))
        extensions = NamedExtensionManager(names=sorted(allow & available), **options)
    for ext in extensions:
        if manager.is_registered(ext.plugin) or manager.has_plugin(ext.name):
            continue
        try:
            manager.register(ext.plugin, name=ext.name)
        except Exception as exc:  # a malformed hookimpl
            _on_load_failure(manager, ext.entry_point, exc)
            continue
        _report.loaded[ext.name] = getattr(ext.plugin, "__name__", repr(ext.plugin))


def plugin_report() -> PluginReport:
    get_plugin_manager()
    return _report


def reset_plugins() -> None:
    """Forget the loaded manager (tests; a new process loads plugins again by itself)."""
    global _manager, _report
    with _lock:
        _manager = None
        _report = PluginReport()
        from sonar import registry

        registry.clear_caches()


def collect(hook_name: str) -> list[tuple[Any, ...]]:
    """Call a ``register``-style hook and return every ``register(*args)`` call it made."""
    calls: list[tuple[Any, ...]] = []

    def register(*args: Any) -> None:
        calls.append(args)

    getattr(get_plugin_manager().hook, hook_name)(register=register)
    return calls
