"""sonar-server declares its own hookspecs (API surfaces, tool-call and reasoning parsers);
sonar-core names none of them, and adds them only through ``sonar_add_hookspecs``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager

SERVER_HOOKS = ("sonar_register_api_surfaces", "sonar_register_tool_parsers", "sonar_register_reasoning_parsers")


def test_core_hookspecs_name_no_server_concept() -> None:
    import sonar.hookspecs

    assert not [name for name in SERVER_HOOKS if hasattr(sonar.hookspecs, name)]
    assert "sonar_server" not in Path(sonar.hookspecs.__file__).read_text()


def test_the_servers_specs_come_from_its_own_module_in_a_fresh_process() -> None:
    script = (
        "from sonar.plugins import get_plugin_manager\n"
        "m = get_plugin_manager()\n"
        f"print(sorted({{getattr(m.hook, n).spec.namespace.__name__ for n in {SERVER_HOOKS!r}}}))\n"
        "from sonar_server.parsers import tool_parsers, reasoning_parsers\n"
        "print(sorted(tool_parsers()), sorted(reasoning_parsers()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "['sonar_server.hookspecs']"
    assert out[1] == "['hermes', 'llama3_json', 'mistral', 'pythonic', 'qwen'] ['deepseek_r1', 'qwen3']"


def test_server_hooks_answer_even_when_sonar_plugins_leaves_the_server_out() -> None:
    script = "from sonar_server.parsers import tool_parsers\nprint(tool_parsers())\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, env={**os.environ, "SONAR_PLUGINS": "cpu"})
    assert result.returncode == 0 and result.stdout.strip() == "{}", result.stderr


class _AcmeParsers:
    @hookimpl
    def sonar_register_tool_parsers(self, register):
        register("acme", "sonar_server.parsers.tools:HermesToolParser")


def test_a_plugin_registers_a_tool_parser_through_the_servers_spec() -> None:
    from sonar_server.parsers import make_tool_parser

    manager = get_plugin_manager()
    plugin = _AcmeParsers()
    manager.register(plugin, name="test-acme-parsers")
    try:
        parser = make_tool_parser("acme")
        result = parser.extract('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"x": 1}')]
    finally:
        manager.unregister(plugin)
