"""Plugin discovery end to end: a real dummy platform package, installed through its entry points.

The package (tests/plugins/sonar_dummy_platform) registers a platform ``dummy`` that detects its
"hardware" only when ``SONAR_DUMMY_PLATFORM=1``, and a second plugin that fails to import when
``SONAR_DUMMY_BROKEN=1``; with neither variable set it changes nothing for other tests. Each
scenario runs in a fresh interpreter, so entry points are read again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import site_has_entry_point, with_site

DUMMY_ENTRY_POINTS = {"dummy", "dummy_broken"}
SONAR_VARIABLES = ("SONAR_PLATFORM", "SONAR_PLUGINS", "SONAR_DUMMY_PLATFORM", "SONAR_DUMMY_BROKEN")

# what a fresh process sees: plugin report and platform selection, as JSON
PROBE = """
import json
from sonar.plugins import plugin_report
from sonar.platform import detect_platforms
report = plugin_report()
try:
    selection = detect_platforms()
    platform, reason = (selection.platform.name if selection.platform else None), selection.reason
    candidates = selection.candidates
except RuntimeError as exc:
    platform, reason, candidates = None, f"error: {exc}", {}
print(json.dumps({"loaded": report.loaded, "failed": report.failed, "skipped": report.skipped,
                  "platform": platform, "reason": reason, "candidates": candidates}))
"""


@pytest.fixture(scope="module")
def dummy_site(plugin_site) -> Path:
    """The dummy package installed where only this module's fresh processes see it."""
    site = plugin_site("sonar_dummy_platform")
    assert all(site_has_entry_point(site, name) for name in DUMMY_ENTRY_POINTS), "the installed dummy package lacks its entry points"
    return site


def run_fresh(site: Path, args: list[str], **variables: str) -> subprocess.CompletedProcess[str]:
    env = with_site({k: v for k, v in os.environ.items() if k not in SONAR_VARIABLES}, site)
    env.update(variables)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


def probe(site: Path, **variables: str) -> dict[str, Any]:
    result = run_fresh(site, ["-c", PROBE], **variables)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_its_hardware_the_dummy_leaves_cpu_selected(dummy_site: Path) -> None:
    seen = probe(dummy_site)
    assert {"cpu", "dummy", "dummy_broken"} <= set(seen["loaded"])
    assert seen["failed"] == {}
    assert seen["candidates"]["dummy"] is None
    assert seen["platform"] == "cpu"
    assert seen["reason"] == "no accelerator detected; CPU fallback"


def test_detected_accelerator_wins_over_cpu(dummy_site: Path) -> None:
    seen = probe(dummy_site, SONAR_DUMMY_PLATFORM="1")
    assert seen["loaded"]["dummy"] == "sonar_dummy_platform.plugin"
    assert seen["candidates"]["cpu"] == "sonar_cpu.platform:CpuPlatform"
    assert seen["candidates"]["dummy"] == "sonar_dummy_platform.platform:DummyPlatform"
    assert seen["platform"] == "dummy"
    assert seen["reason"] == "dummy hardware detected"


def test_sonar_platform_forces_cpu_over_a_detected_accelerator(dummy_site: Path) -> None:
    seen = probe(dummy_site, SONAR_DUMMY_PLATFORM="1", SONAR_PLATFORM="cpu")
    assert seen["platform"] == "cpu"
    assert seen["reason"] == "forced by SONAR_PLATFORM=cpu"


def test_broken_plugin_is_reported_and_the_others_still_load(dummy_site: Path) -> None:
    seen = probe(dummy_site, SONAR_DUMMY_BROKEN="1", SONAR_DUMMY_PLATFORM="1")
    assert list(seen["failed"]) == ["dummy_broken"]
    assert "ImportError" in seen["failed"]["dummy_broken"] and "dummy-driver" in seen["failed"]["dummy_broken"]
    assert "dummy_broken" not in seen["loaded"]
    assert {"cpu", "models", "dummy"} <= set(seen["loaded"])
    assert seen["platform"] == "dummy"


def test_sonar_plugins_allowlist_loads_only_the_named_plugins(dummy_site: Path) -> None:
    seen = probe(dummy_site, SONAR_PLUGINS="cpu", SONAR_DUMMY_PLATFORM="1")
    assert list(seen["loaded"]) == ["cpu"]
    assert {"models", "dummy", "dummy_broken"} <= set(seen["skipped"])
    assert seen["candidates"] == {"cpu": "sonar_cpu.platform:CpuPlatform"}
    assert seen["platform"] == "cpu"


def test_plugins_outside_the_allowlist_are_not_imported(dummy_site: Path) -> None:
    seen = probe(dummy_site, SONAR_PLUGINS="cpu", SONAR_DUMMY_BROKEN="1")
    assert seen["failed"] == {}
    assert "dummy_broken" in seen["skipped"]


@pytest.mark.skipif(importlib.util.find_spec("sonar.cli.plugins") is None, reason="sonar.cli.plugins not available")
def test_sonar_plugins_command_shows_discovery_failures_and_selection(dummy_site: Path) -> None:
    result = run_fresh(dummy_site, ["-m", "sonar.cli.main", "plugins"], SONAR_DUMMY_PLATFORM="1", SONAR_DUMMY_BROKEN="1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    loaded = out.split("plugins loaded:")[1].split("plugins failed:")[0]
    failed = out.split("plugins failed:")[1].split("platforms:")[0]
    assert "sonar_cpu.plugin" in loaded and "sonar_dummy_platform.plugin" in loaded
    assert "dummy_broken" in failed and "dummy-driver" in failed
    assert "selected platform: dummy (dummy hardware detected)" in out
    # the broken plugin's warning goes to the log, not the report
    assert "dummy_broken" in result.stderr
