"""A sampler stage added by installing a package: the example plugin (tests/plugins/
sonar_example_stage) registers ``example_boost`` through its entry point alone. Each scenario
runs in a fresh interpreter (offline) or a real ``sonar serve`` (HTTP), so entry points are
read again; the package is installed in a folder only they see."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import site_has_entry_point, with_site

PROMPT = [100, 200, 300, 400, 500]
BOOSTED_TOKEN = 4242
NUM_TOKENS = 8

# the offline LLM in a fresh process: plain, boosted and reordered requests, and the errors
PROBE = """
import json, sys
from sonar import LLM, SamplingParams
from sonar.plugins import plugin_report
prompt_ids, token, num_tokens = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
prompt = {"prompt_token_ids": prompt_ids}
boost = {"example.boost_token": token, "example.boost": 1000.0}
greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
top1 = SamplingParams(temperature=1.0, top_k=1, seed=0, max_tokens=num_tokens, ignore_eos=True, extra_args=boost)
requests = {
    "plain": greedy,
    "boosted": greedy.clone(extra_args=boost),
    "top1_boost_first": top1,  # default order: the stage (rank 550) runs before top-k (600)
    "top1_topk_first": top1.clone(sampler_priority=["top_k", "example_boost"]),
}
outs = llm.generate([prompt] * len(requests), list(requests.values()))
seen = {name: out.outputs[0].token_ids for name, out in zip(requests, outs)}
seen["boosted_text"] = outs[1].outputs[0].text
seen["plain_alone"] = llm.generate([prompt], [greedy])[0].outputs[0].token_ids
errors = {}
for name, extra in {"bad_value": {"example.boost_token": 1, "example.boost": "x"}, "unknown": {"example.nope": 1}}.items():
    try:
        llm.generate([prompt], [greedy.clone(extra_args=extra)])
        errors[name] = None
    except ValueError as exc:
        errors[name] = str(exc)
print(json.dumps({"loaded": plugin_report().loaded, "seen": seen, "errors": errors}))
"""


@pytest.fixture(scope="module")
def example_stage(plugin_site) -> Path:
    """The example package, installed where only this module's fresh processes see it."""
    site = plugin_site("sonar_example_stage")
    assert site_has_entry_point(site, "example_stage"), "the installed sonar-example-stage lacks its entry point"
    return site


@pytest.fixture(scope="module")
def offline(example_stage: Path, tiny_model_dir) -> dict[str, Any]:
    args = [str(tiny_model_dir("llama")), json.dumps(PROMPT), str(BOOSTED_TOKEN), str(NUM_TOKENS)]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], check=False, capture_output=True, text=True, timeout=300,
        env=with_site({**os.environ, "OMP_NUM_THREADS": "1"}, example_stage),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_stage_loads_from_its_entry_point(offline: dict[str, Any]) -> None:
    assert offline["loaded"]["example_stage"] == "sonar_example_stage.plugin"


def test_the_stage_parameter_changes_the_output(offline: dict[str, Any]) -> None:
    seen = offline["seen"]
    assert BOOSTED_TOKEN not in seen["plain"], "the boosted token must not be the model's own choice"
    assert seen["boosted"] == [BOOSTED_TOKEN] * NUM_TOKENS


def test_a_request_not_using_the_stage_is_unchanged(offline: dict[str, Any]) -> None:
    seen = offline["seen"]
    assert seen["plain"] == seen["plain_alone"]


def test_sampler_priority_orders_the_plugin_stage(offline: dict[str, Any]) -> None:
    seen = offline["seen"]
    # boost, then top-k=1: the boosted token is the one kept
    assert seen["top1_boost_first"] == [BOOSTED_TOKEN] * NUM_TOKENS
    # top-k=1, then boost: the boost lands on a removed token; the model's argmax stays
    assert seen["top1_topk_first"] == seen["plain"]


def test_bad_values_are_a_value_error_naming_the_field(offline: dict[str, Any]) -> None:
    errors = offline["errors"]
    assert errors["bad_value"].startswith('extra_args["example.boost"] must be a number')
    assert errors["unknown"].startswith('extra_args["example.nope"] is not a parameter of any registered sampler stage')
    assert "example.boost_token" in errors["unknown"]


# --- over HTTP ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(example_stage: Path, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    sonar = shutil.which("sonar", path=str(Path(sys.executable).parent))
    command = [sonar] if sonar else [sys.executable, "-m", "sonar.cli.main"]
    args = ["serve", str(tiny_model_dir("llama")), "--port", str(port), "--kv-cache-memory-bytes", str(8 << 20), "--max-model-len", "128"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen([*command, *args], stdout=sink, stderr=subprocess.STDOUT, env=with_site(os.environ, example_stage))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"sonar serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, "sonar serve did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _complete(url: str, **fields: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_http_extra_args_and_vllm_xargs_reach_the_stage(server_url: str, offline: dict[str, Any]) -> None:
    boost = {"example.boost_token": BOOSTED_TOKEN, "example.boost": 1000.0}
    for field in ("extra_args", "vllm_xargs"):
        response = _complete(server_url, **{field: boost})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == offline["seen"]["boosted_text"]


def test_http_bad_stage_parameters_are_a_400_naming_the_field(server_url: str) -> None:
    response = _complete(server_url, extra_args={"example.boost_token": 1, "example.boost": "x"})
    assert response.status_code == 400
    assert 'extra_args["example.boost"] must be a number' in response.json()["error"]["message"]
    response = _complete(server_url, vllm_xargs={"example.nope": 1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert 'extra_args["example.nope"]' in message and "example.boost_token" in message
