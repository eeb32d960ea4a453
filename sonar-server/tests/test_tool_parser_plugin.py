"""``--tool-parser-plugin FILE`` (vLLM's flag): a Python file whose ``register_tool_parser``
classes ``--tool-call-parser`` can name, imported by every API server process; a file that is
missing or fails to import stops ``sonar serve`` at once, naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess
from test_cli_flags import EARLY_FAILURE_S, run_sonar
from test_tools_api import TOOLS, streamed_calls

PLUGIN = '''
import json

from sonar_server.parsers import ToolCall, ToolCallResult, ToolParser, register_tool_parser


@register_tool_parser(["shout", "shout_v2"])
class ShoutToolParser(ToolParser):
    """One call per line: CALL <name> <JSON arguments>."""

    marker = "CALL "

    def extract(self, text):
        content, calls = [], []
        for line in text.splitlines(keepends=True):
            if line.startswith(self.marker):
                name, _, arguments = line[len(self.marker):].strip().partition(" ")
                calls.append(ToolCall(name, json.dumps(json.loads(arguments or "{}"))))
            else:
                content.append(line)
        return ToolCallResult("".join(content), calls)

    def find_start(self, text, start):
        return text.find(self.marker, start)

    def held_back(self, text, emitted):
        return next((n for n in range(len(self.marker) - 1, 0, -1) if text.endswith(self.marker[:n])), 0)
'''

# a chat template with a place for tools: the server's tool-call parser reads the answer (a
# template without one gets Sonar's own tool prompt and its parser)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if tools %}tools: {{ tools | length }}\n{% endif %}assistant:"
FORCED = 'CALL get_time {"zone": "CET"}'


@pytest.fixture(scope="module")
def plugin_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two API servers, so the plugin is imported by processes the serve command started too."""
    folder = tmp_path_factory.mktemp("tool-parser-plugin")
    (folder / "shout_parser.py").write_text(PLUGIN)
    process = ServerProcess(
        [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
         "--api-server-count", "2", "--tool-parser-plugin", str(folder / "shout_parser.py"), "--tool-call-parser", "shout_v2",
         "--enable-auto-tool-choice", "--chat-template", TEMPLATE],
    )  # fmt: skip
    yield process
    process.stop()


def test_a_plugin_files_parser_finds_the_tool_calls(plugin_server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Time in Paris?"}], "tools": TOOLS, "max_tokens": 40,
            "temperature": 0, "guided_choice": [FORCED]}  # fmt: skip
    for _ in range(6):  # a new connection each: the kernel spreads them over both API servers
        reply = httpx.post(f"{plugin_server.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] == [("get_time", {"zone": "CET"})]

    import openai

    client = openai.OpenAI(base_url=f"{plugin_server.url}/v1", api_key="unused", max_retries=0)
    calls, content, finish = streamed_calls(client.chat.completions.create(**{k: v for k, v in body.items() if k != "guided_choice"},
                                                                           extra_body={"guided_choice": [FORCED]}, stream=True))  # fmt: skip
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "CET"})]
    assert finish == "tool_calls" and content == ""


@pytest.mark.parametrize(
    "source, message",
    [
        (None, "--tool-parser-plugin '{path}': no such file"),
        ("import json\n\nraise RuntimeError('no licence key')\n", "--tool-parser-plugin '{path}' failed to import (line 3): RuntimeError: no licence key"),
        ("def broken(:\n", "--tool-parser-plugin '{path}' failed to import (line 1): SyntaxError"),
        ("from sonar_server.parsers import register_tool_parser\n\n\n@register_tool_parser('x')\nclass NotAParser:\n    pass\n",
         "failed to import (line 4): TypeError: register_tool_parser('x') decorates a sonar_server.parsers.ToolParser subclass"),
    ],
    ids=["missing", "raises", "syntax error", "not a ToolParser"],
)
def test_a_missing_or_broken_plugin_file_stops_serve_at_once_naming_it(tmp_path: Path, source: str | None, message: str) -> None:
    path = tmp_path / "my_parsers.py"
    if source is not None:
        path.write_text(source)
    done, elapsed = run_sonar("serve", "--tool-parser-plugin", str(path), "--tool-call-parser", "x", "--enable-auto-tool-choice")
    assert done.returncode != 0
    assert message.format(path=path) in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert elapsed < EARLY_FAILURE_S, f"took {elapsed:.1f} s"


def test_a_parser_name_the_plugin_does_not_register_is_refused_listing_its_names(tmp_path: Path) -> None:
    path = tmp_path / "shout_parser.py"
    path.write_text(PLUGIN)
    done, _ = run_sonar("serve", "--tool-parser-plugin", str(path), "--tool-call-parser", "whisper", "--enable-auto-tool-choice")
    assert done.returncode != 0
    assert "--tool-call-parser 'whisper' is not registered" in done.stderr and "'shout'" in done.stderr and "'hermes'" in done.stderr
