"""A pretend accelerator that runs on the CPU's worker and attention backend."""

from __future__ import annotations

from sonar.platform import Platform


class DummyPlatform(Platform):
    name = "dummy"
    device_type = "cpu"
    worker_cls = "sonar_cpu.worker:CpuWorker"
    attention_backend_cls = "sonar_cpu.attention:CpuAttentionBackend"

    @classmethod
    def total_memory_bytes(cls) -> int:
        return 1024**3

    @classmethod
    def available_memory_bytes(cls) -> int:
        return 512 * 1024**2

    @classmethod
    def describe(cls) -> str:
        return "dummy: 1 pretend device, 1.0 GiB memory"
