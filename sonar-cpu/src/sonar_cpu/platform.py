"""The CPU platform: always present, the fallback when no accelerator is detected."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sonar.platform import Platform

MEMINFO_PATH = Path("/proc/meminfo")


def read_meminfo(field: str, path: Path = MEMINFO_PATH) -> int | None:
    """One field of ``/proc/meminfo`` in bytes (``"MemTotal"``, ``"MemAvailable"``), or None
    where the file or the field is missing (not Linux)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == field:
            amount, *unit = rest.split()
            return int(amount) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def _sysconf_bytes(pages_name: str) -> int | None:
    try:
        return os.sysconf(pages_name) * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def num_usable_cores() -> int:
    """Cores this process may run on (respects CPU affinity and container cpusets)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class CpuPlatform(Platform):
    """Runs models on the host CPU with PyTorch's CPU kernels."""

    name = "cpu"
    device_type = "cpu"
    worker_cls = "sonar_cpu.worker:CpuWorker"
    attention_backend_cls = "sonar_cpu.attention:CpuAttentionBackend"
    ops_module = "sonar_cpu.ops"  # fused norms and rotary, int4 group kernels for quantized weights
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")  # fp8_e4m3: scaled per layer; fp8_e5m2: unscaled; see the attention backend
    dist_backend = "gloo"
    #: torch's CPU thread pools start on first use: a frontend that has not computed yet (one
    #: thread, checked before each fork) forks its engine cores safely
    fork_children = True
    #: ``gpu_memory_utilization`` sizes the cache from host RAM; without a bound a default run
    #: would reserve most of it. ``kv_cache_memory_bytes`` sets any size exactly.
    max_default_kv_cache_bytes = 4 * 1024**3

    @classmethod
    def replica_env(cls, index: int, num_replicas: int, ranks_per_replica: int = 1) -> dict[str, str]:
        """Replicas share the cores: each process (a replica's, or each of its ranks') gets its
        own slice of the torch threads (unless ``SONAR_CPU_THREADS`` says otherwise); a
        replica's ranks find the slice set and keep it."""
        processes = num_replicas * ranks_per_replica
        if processes == 1 or os.environ.get("SONAR_CPU_THREADS"):
            return {}
        return {"SONAR_CPU_THREADS": str(max(1, num_usable_cores() // processes))}

    @classmethod
    def rank_env(cls, rank: int, world_size: int) -> dict[str, str]:
        """Tensor-parallel ranks share the cores as replicas do: each its slice of the threads."""
        return cls.replica_env(rank, world_size)

    @classmethod
    def total_memory_bytes(cls) -> int:
        """Physical memory of the host (``MemTotal``)."""
        total = read_meminfo("MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
        if total is None:
            raise RuntimeError("cannot read the host's memory size; set kv_cache_memory_bytes explicitly")
        return total

    @classmethod
    def available_memory_bytes(cls) -> int:
        """Memory the kernel can hand out now without swapping (``MemAvailable``)."""
        available = read_meminfo("MemAvailable") or _sysconf_bytes("SC_AVPHYS_PAGES")
        if available is None:
            raise RuntimeError("cannot read the host's free memory; set kv_cache_memory_bytes explicitly")
        return available

    @classmethod
    def describe(cls) -> str:
        """``cpu: 8 cores, 31.2 GiB memory (27.9 GiB available)``."""
        gib = 1024**3
        try:
            memory = f"{cls.total_memory_bytes() / gib:.1f} GiB memory ({cls.available_memory_bytes() / gib:.1f} GiB available)"
        except RuntimeError:
            memory = "memory unknown"
        return f"{cls.name}: {num_usable_cores()} cores, {memory}"
