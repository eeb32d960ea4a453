"""sonar-server's own plugin: registers its API surfaces the way a third-party package would,
through the ``sonar.plugins`` entry point and the ``sonar_register_api_surfaces`` hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sonar.hookspecs import hookimpl


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
