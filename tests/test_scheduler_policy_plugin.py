"""A scheduling policy from an installed package's entry point alone
(tests/plugins/sonar_example_policy registers ``shortest-first``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import site_has_entry_point, with_site

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


@pytest.fixture(scope="module")
def policy_site(plugin_site) -> Path:
    """The example policy package, installed where only this module's fresh processes see it."""
    site = plugin_site("sonar_example_policy")
    assert site_has_entry_point(site, "example_policy"), "the installed sonar-example-policy lacks its entry point"
    return site


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("policy-model")
    build_tiny_model("llama", folder)
    return str(folder)


def _run(model: str, policy: str, site: Path) -> subprocess.CompletedProcess[str]:
    env = with_site({"SONAR_PLATFORM": "cpu", "PATH": "/usr/bin:/bin"}, site)
    return subprocess.run([sys.executable, "-c", RUN, model, policy], capture_output=True, text=True, timeout=300, env=env)


def test_the_plugin_policy_orders_the_queue(policy_site: Path, model: str) -> None:
    result = _run(model, "shortest-first", policy_site)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"fcfs", "priority", "shortest-first"} <= set(seen["policies"])
    assert seen["order"] == ["short", "medium", "long"]
    fcfs = json.loads(_run(model, "fcfs", policy_site).stdout.strip().splitlines()[-1])
    assert fcfs["order"] == ["long", "medium", "short"]


def test_an_unregistered_policy_is_refused_by_name(policy_site: Path, model: str) -> None:
    result = _run(model, "lottery", policy_site)
    assert result.returncode != 0
    assert "scheduling_policy='lottery' is not registered" in result.stderr
    assert "shortest-first" in result.stderr
