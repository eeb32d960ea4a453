"""The CPU platform: registration, selection, memory and threads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar.platform import detect_platforms
from sonar.plugins import plugin_report
from sonar.registry import import_class
from sonar_cpu.platform import CpuPlatform, read_meminfo
from sonar_cpu.threads import configure_threads


@pytest.fixture(autouse=True)
def no_forced_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SONAR_PLATFORM", raising=False)
    monkeypatch.delenv("SONAR_DUMMY_PLATFORM", raising=False)


def test_cpu_plugin_is_loaded_through_its_entry_point() -> None:
    assert plugin_report().loaded["cpu"] == "sonar_cpu.plugin"


def test_cpu_is_selected_when_no_accelerator_is_detected() -> None:
    selection = detect_platforms()
    assert selection.platform is CpuPlatform
    assert selection.candidates["cpu"] == "sonar_cpu.platform:CpuPlatform"
    assert "CPU fallback" in selection.reason


def test_sonar_platform_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_PLATFORM", "cpu")
    selection = detect_platforms()
    assert selection.platform is CpuPlatform
    assert selection.reason == "forced by SONAR_PLATFORM=cpu"


def test_unknown_forced_platform_names_the_registered_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_PLATFORM", "abacus")
    with pytest.raises(RuntimeError, match=r"SONAR_PLATFORM='abacus'.*'cpu'"):
        detect_platforms()


def test_platform_names_importable_classes() -> None:
    assert CpuPlatform.device() == torch.device("cpu")
    backend_cls = import_class(CpuPlatform.attention_backend_cls)
    assert backend_cls.__name__ == "CpuAttentionBackend"
    assert CpuPlatform.worker_cls == "sonar_cpu.worker:CpuWorker"


def test_memory_comes_from_meminfo() -> None:
    total, available = CpuPlatform.total_memory_bytes(), CpuPlatform.available_memory_bytes()
    assert 0 < available <= total
    assert total > 256 * 1024**2
    assert "cores" in CpuPlatform.describe() and "GiB memory" in CpuPlatform.describe()


def test_read_meminfo_parses_kib(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:  100 kB\nMemAvailable:    8192 kB\n")
    assert read_meminfo("MemTotal", meminfo) == 16384 * 1024
    assert read_meminfo("MemAvailable", meminfo) == 8192 * 1024
    assert read_meminfo("SwapTotal", meminfo) is None
    assert read_meminfo("MemTotal", tmp_path / "missing") is None


def test_threads_follow_sonar_cpu_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("SONAR_CPU_THREADS", "1")
        assert configure_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("SONAR_CPU_THREADS", "lots")
        with pytest.raises(ValueError, match="SONAR_CPU_THREADS='lots' is not an integer"):
            configure_threads()
        monkeypatch.delenv("SONAR_CPU_THREADS")
        assert configure_threads() >= 1
    finally:
        torch.set_num_threads(before)


def test_cpu_worker_sets_threads_before_building_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from sonar_cpu.worker import CpuWorker

    before = torch.get_num_threads()
    monkeypatch.setenv("SONAR_CPU_THREADS", "1")
    worker = CpuWorker.__new__(CpuWorker)  # init_device alone: no model
    try:
        worker.init_device()
        assert worker.num_threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
