"""A scheduling policy from an installed package's entry point alone
(tests/plugins/sonar_example_policy registers ``shortest-first``)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent / "plugins" / "sonar_example_policy"

RUN = """
import json, sys
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.sampling_params import SamplingParams
from sonar.registry import scheduler_policies

policy = sys.argv[2]
engine = LLMEngine(EngineArgs(model=sys.argv[1], scheduling_policy=policy, max_num_seqs=1,
                              kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128))
params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
for name, length in (("long", 30), ("medium", 12), ("short", 3)):
    engine.add_request(name, list(range(5, 5 + length)), params)
finished = []
while engine.has_unfinished_requests():
    finished += [o.request_id for o in engine.step() if o.finished]
print(json.dumps({"order": finished, "policies": sorted(scheduler_policies())}))
"""


def _installed() -> bool:
    try:
        importlib.metadata.distribution("sonar-example-policy")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def policy_plugin() -> None:
    if not _installed():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(PACKAGE)],
            check=True, capture_output=True, text=True,
        )
    yield
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", "sonar-example-policy"], capture_output=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("policy-model")
    build_tiny_model("llama", folder)
    return str(folder)


def _run(model: str, policy: str) -> subprocess.CompletedProcess[str]:
    env = {"SONAR_PLATFORM": "cpu", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", RUN, model, policy], capture_output=True, text=True, timeout=300, env=env)


def test_the_plugin_policy_orders_the_queue(policy_plugin: None, model: str) -> None:
    result = _run(model, "shortest-first")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"fcfs", "priority", "shortest-first"} <= set(seen["policies"])
    assert seen["order"] == ["short", "medium", "long"]
    fcfs = json.loads(_run(model, "fcfs").stdout.strip().splitlines()[-1])
    assert fcfs["order"] == ["long", "medium", "short"]


def test_an_unregistered_policy_is_refused_by_name(policy_plugin: None, model: str) -> None:
    result = _run(model, "lottery")
    assert result.returncode != 0
    assert "scheduling_policy='lottery' is not registered" in result.stderr
    assert "shortest-first" in result.stderr
