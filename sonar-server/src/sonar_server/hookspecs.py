"""sonar-server's own hookspecs, added to Sonar's plugin manager by sonar-server's plugin
(``sonar_add_hookspecs``), the way a pytest plugin adds its hooks: sonar-core names no server
concept.

Implement them with ``sonar.hookspecs.hookimpl`` in any ``sonar.plugins`` entry point, like the
core's hooks.
"""

from __future__ import annotations

from collections.abc import Callable

from sonar.hookspecs import hookspec

# ---------------------------------------------------------------------------------------------
# API surfaces
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_api_surfaces(register: Callable[..., None]) -> None:
    """Register HTTP API surfaces for ``sonar serve``.

    :param register: ``register(name: str, install: Callable[[Any, Any], None])``. The server
        calls ``install(app, state)`` for each surface selected by ``--api`` (all by default),
        with the FastAPI app and the server state (engine client, tokenizer, settings).
    """


# ---------------------------------------------------------------------------------------------
# Output parsers
# ---------------------------------------------------------------------------------------------


@hookspec
def sonar_register_tool_parsers(register: Callable[..., None]) -> None:
    """Register tool-call parsers (``sonar serve --tool-call-parser NAME``).

    :param register: ``register(name: str, parser: str | type)``. ``parser`` is a
        ``sonar_server.parsers.ToolParser`` subclass or its ``"package.module:Class"`` path
        (imported only when selected); it splits a model's output into text and tool calls.
    """


@hookspec
def sonar_register_reasoning_parsers(register: Callable[..., None]) -> None:
    """Register reasoning parsers (``sonar serve --reasoning-parser NAME``).

    :param register: ``register(name: str, parser: str | type)``. ``parser`` is a
        ``sonar_server.parsers.ReasoningParser`` subclass or its ``"package.module:Class"``
        path; it separates a model's reasoning from its answer.
    """
