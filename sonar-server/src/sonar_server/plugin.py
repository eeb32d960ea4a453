"""sonar-server's own plugin: adds the server's hookspecs, and registers its API surfaces,
tool-call parsers and reasoning parsers the way a third-party package would, through the
``sonar.plugins`` entry point."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy
from sonar.hookspecs import hookimpl


@hookimpl
def sonar_add_hookspecs(manager: pluggy.PluginManager) -> None:
    add_server_hookspecs(manager)


def add_server_hookspecs(manager: pluggy.PluginManager) -> None:
    """Add ``sonar_server.hookspecs`` to ``manager`` unless it holds them already (the server
    also calls this itself, for a process whose ``SONAR_PLUGINS`` leaves this plugin out)."""
    from sonar_server import hookspecs

    if getattr(getattr(manager.hook, "sonar_register_api_surfaces", None), "spec", None) is None:
        manager.add_hookspecs(hookspecs)


def _lazy(module: str) -> Callable[[Any, Any], None]:
    def install(app: Any, state: Any) -> None:
        import importlib

        importlib.import_module(module).install(app, state)

    return install


@hookimpl
def sonar_register_api_surfaces(register: Callable[..., None]) -> None:
    register("openai", _lazy("sonar_server.surfaces.openai"))
    register("anthropic", _lazy("sonar_server.surfaces.anthropic"))
    register("kobold", _lazy("sonar_server.surfaces.kobold"))
    register("ops", _lazy("sonar_server.surfaces.ops"))


@hookimpl
def sonar_register_tool_parsers(register: Callable[..., None]) -> None:
    register("hermes", "sonar_server.parsers.tools:HermesToolParser")
    register("qwen", "sonar_server.parsers.tools:HermesToolParser")
    register("llama3_json", "sonar_server.parsers.tools:Llama3JsonToolParser")
    register("mistral", "sonar_server.parsers.tools:MistralToolParser")
    register("pythonic", "sonar_server.parsers.tools:PythonicToolParser")


@hookimpl
def sonar_register_reasoning_parsers(register: Callable[..., None]) -> None:
    register("qwen3", "sonar_server.parsers.reasoning:Qwen3ReasoningParser")
    register("deepseek_r1", "sonar_server.parsers.reasoning:DeepSeekR1ReasoningParser")


@hookimpl
def sonar_register_cli_commands(register: Callable[..., None]) -> None:
    register("serve", "sonar_server.cli:add_serve_parser")
    register("bench serve", "sonar_server.cli:add_bench_serve_parser")
    register("proxy", "sonar_server.proxy:add_proxy_parser")


def collect_server_hook(hook_name: str) -> list[tuple[Any, ...]]:
    """``sonar.plugins.collect`` for one of sonar-server's own hooks."""
    from sonar.plugins import collect, get_plugin_manager

    add_server_hookspecs(get_plugin_manager())
    return collect(hook_name)
