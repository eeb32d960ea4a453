"""The cuda platform plugin: discovered through its entry point, cheap and honest detection."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sonar import plugins
from sonar.platform import detect_platforms
from sonar_cuda import plugin
from sonar_cuda.platform import CudaPlatform


def test_entry_point_registers_the_cuda_platform() -> None:
    plugins.reset_plugins()
    try:
        selection = detect_platforms()
        assert "cuda" in selection.candidates
        assert plugins.plugin_report().loaded.get("cuda") == "sonar_cuda.plugin"
        expected = plugin.PLATFORM_CLASS if torch.cuda.is_available() else None
        assert selection.candidates["cuda"] == expected
    finally:
        plugins.reset_plugins()


def test_detection_imports_neither_triton_nor_kernels() -> None:
    code = (
        "import sys; from sonar_cuda.plugin import detect_cuda; detect_cuda(); "
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('sonar_cuda.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['sonar_cuda.plugin']"


def test_hidden_gpus_are_not_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert plugin.detect_cuda() is None


def test_no_driver_means_no_torch_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(plugin, "_driver_visible", lambda: None)

    def fail() -> bool:
        raise AssertionError("torch.cuda must not be asked when no driver is visible")

    monkeypatch.setattr(torch.cuda, "is_available", fail)
    assert plugin.detect_cuda() is None


def test_platform_classes_import_and_fit_the_core() -> None:
    """The dotted paths the platform names resolve to the classes the engine needs."""
    from sonar.attention import AttentionBackend
    from sonar.registry import import_class
    from sonar.worker.worker import Worker

    assert issubclass(import_class(CudaPlatform.attention_backend_cls), AttentionBackend)
    assert issubclass(import_class(CudaPlatform.worker_cls), Worker)
    assert CudaPlatform.device(1) == torch.device("cuda", 1)
    assert CudaPlatform.replica_env(0, 1) == {}


def test_replicas_get_one_visible_gpu_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [CudaPlatform.replica_env(i, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(ValueError, match="needs 3 GPUs; 2 are visible"):
        CudaPlatform.replica_env(0, 3)


def test_replicas_of_tensor_parallel_groups_get_consecutive_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,6")
    assert [CudaPlatform.replica_env(i, 2, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    with pytest.raises(ValueError, match="data_parallel_size=3 x 2 ranks each needs 6 GPUs; 5 are visible"):
        CudaPlatform.replica_env(0, 3, 2)


@pytest.mark.cuda
def test_platform_reports_device_memory() -> None:
    total, free = CudaPlatform.total_memory_bytes(), CudaPlatform.available_memory_bytes()
    assert 0 < free <= total
    assert CudaPlatform.describe().startswith("cuda: ")


def test_worker_is_the_core_worker_on_a_gpu() -> None:
    from sonar.worker.worker import Worker
    from sonar_cuda.worker import CudaWorker

    assert issubclass(CudaWorker, Worker)
