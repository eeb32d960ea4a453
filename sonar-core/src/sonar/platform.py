"""The Platform interface and its selection.

A platform is a class of class attributes and classmethods with safe defaults. Heavy classes
(worker, attention backend) are named as dotted strings and imported only when used, so that
detecting one platform never imports another's kernels.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from sonar.plugins import collect
from sonar.registry import import_class

logger = logging.getLogger(__name__)


class Platform:
    """Base class for hardware platforms. Subclass it and register it with
    ``sonar_register_platforms``."""

    #: Short name, as users pass it in ``SONAR_PLATFORM``.
    name: str = "unspecified"
    #: torch device type (``"cpu"``, ``"cuda"``).
    device_type: str = "cpu"
    #: ``"module:Class"`` of the worker that runs the model on one device.
    worker_cls: str = ""
    #: ``"module:Class"`` of the attention backend over the paged KV cache.
    attention_backend_cls: str = ""
    #: ``"module"`` whose ``OPS`` dict replaces some of ``sonar.ops`` (products, norms,
    #: rotary, activation, argmax) with this platform's kernels for its device type; "" for none.
    ops_module: str = ""
    #: dtypes this platform can run, first is the default for ``dtype="auto"`` when the
    #: checkpoint's own dtype is not supported.
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    #: ``kv_cache_dtype`` values (canonical names) this platform's attention backend reads and
    #: writes; "auto" is the model's dtype.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    #: The ``torch.distributed`` backend the ranks of a parallel run (tensor parallelism,
    #: ``sonar.executor.multiproc``) join their group with: ``"gloo"`` on the CPU, ``"nccl"``
    #: on NVIDIA GPUs.
    dist_backend: str = "gloo"
    #: ``"module:Class"`` of the ``sonar.distributed.Communicator`` whose collectives
    #: (all-reduce, all-gather) the tensor-parallel layers run on this platform.
    communicator_cls: str = "sonar.distributed:Communicator"
    #: Whether the engine schedules and launches each step before reading the last one's
    #: results, by default. Worth it where launching returns before the device finishes the
    #: step (an accelerator's queue), so the host's work overlaps the device's; where the
    #: host computes the step itself it only delays every output by one step.
    async_scheduling: bool = False
    #: Whether a process that has imported torch, and done nothing yet on this platform's
    #: device, may start engine cores by forking itself rather than as fresh interpreters
    #: (they skip importing torch, transformers and Sonar again: seconds of CPU each). Only
    #: where the device's runtime and thread pools survive a fork; a process that runs more
    #: than one thread never forks whatever this says.
    fork_children: bool = False

    @classmethod
    def replica_env(cls, index: int, num_replicas: int, ranks_per_replica: int = 1) -> dict[str, str]:
        """Environment for the engine-core process of data-parallel replica ``index`` of
        ``num_replicas``, each with ``ranks_per_replica`` worker ranks (its tensor-parallel
        group): what makes it use its own devices (``CUDA_VISIBLE_DEVICES``: replica ``i``
        gets devices ``i * ranks .. i * ranks + ranks - 1``) or its share of the host. Its
        ranks then pick their device among those with ``device(rank)``. Default: nothing
        (every replica sees the same devices)."""
        return {}

    @classmethod
    def rank_env(cls, rank: int, world_size: int) -> dict[str, str]:
        """Environment for the worker process of tensor-parallel rank ``rank`` of
        ``world_size`` on this host (every rank sees every device and uses
        ``device(rank)``): what gives it its share of the host where the ranks share one (CPU
        threads). Default: nothing."""
        return {}

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        """The torch device for local rank ``index``."""
        return torch.device(cls.device_type)

    @classmethod
    def total_memory_bytes(cls) -> int:
        """Memory of one device, used by ``gpu_memory_utilization`` to size the KV cache."""
        raise NotImplementedError

    @classmethod
    def available_memory_bytes(cls) -> int:
        """Memory free for the KV cache right now (after weights are loaded)."""
        raise NotImplementedError

    #: Upper bound on the KV cache when sized by ``gpu_memory_utilization`` (None: no bound).
    #: Host-memory platforms set one so that a default run does not reserve most of the RAM.
    max_default_kv_cache_bytes: int | None = None

    #: Whether ``reset_peak_memory`` / ``peak_memory_bytes`` measure this device's memory (the
    #: worker then profiles the largest step before sizing the KV cache).
    measures_memory: bool = False

    @classmethod
    def reset_peak_memory(cls) -> None:
        """Start a new peak-memory measurement (where ``measures_memory``)."""

    @classmethod
    def allocated_memory_bytes(cls) -> int:
        """Bytes this process's allocator holds on the device now, cached blocks included
        (where ``measures_memory``)."""
        return 0

    @classmethod
    def peak_memory_bytes(cls) -> int:
        """The most bytes the allocator held since ``reset_peak_memory``."""
        return 0

    @classmethod
    def release_cached_memory(cls) -> None:
        """Give memory the allocator caches but no tensor holds back to the device."""

    @classmethod
    def kv_cache_budget_bytes(cls, utilization: float, reserved_bytes: int = 0) -> int:
        """Bytes the KV cache may take once weights are loaded: ``utilization`` of the device's
        memory, minus what is already in use, minus ``reserved_bytes`` (what the largest step
        needs beyond it)."""
        total = cls.total_memory_bytes()
        in_use = total - cls.available_memory_bytes()
        budget = max(0, int(total * utilization) - in_use - reserved_bytes)
        if cls.max_default_kv_cache_bytes is not None:
            budget = min(budget, cls.max_default_kv_cache_bytes)
        return budget

    @classmethod
    def describe(cls) -> str:
        """One line for ``sonar plugins``: the device and its memory."""
        return cls.name

    @classmethod
    def synchronize(cls) -> None:
        """Wait for all queued device work (used by benchmarks)."""


@dataclass(slots=True)
class PlatformSelection:
    platform: type[Platform] | None
    reason: str
    candidates: dict[str, str | None] = field(default_factory=dict)  # name -> class path or None
    errors: dict[str, str] = field(default_factory=dict)


def detect_platforms() -> PlatformSelection:
    """Run every registered detector and choose one platform, with the reason why."""
    candidates: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    for name, detect in collect("sonar_register_platforms"):
        try:
            candidates[name] = detect()
        except Exception as exc:  # a detector must never break the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            candidates[name] = None
            logger.warning("platform %r detection failed: %s", name, exc)
    forced = os.environ.get("SONAR_PLATFORM", "").strip()
    active = {name: path for name, path in candidates.items() if path}
    if forced:
        if forced not in candidates:
            raise RuntimeError(
                f"SONAR_PLATFORM={forced!r} but no such platform is registered; "
                f"registered: {sorted(candidates)}"
            )
        if not active.get(forced):
            raise RuntimeError(f"SONAR_PLATFORM={forced!r} but that platform's hardware was not detected")
        return PlatformSelection(import_class(active[forced]), f"forced by SONAR_PLATFORM={forced}", candidates, errors)
    # the CPU platform is the fallback: any accelerator wins over it
    accelerators = {n: p for n, p in active.items() if n != "cpu"}
    if len(accelerators) > 1:
        raise RuntimeError(
            f"several platforms detected their hardware: {sorted(accelerators)}; "
            f"choose one with SONAR_PLATFORM=<name>"
        )
    if accelerators:
        (name, path), = accelerators.items()
        return PlatformSelection(import_class(path), f"{name} hardware detected", candidates, errors)
    if "cpu" in active:
        return PlatformSelection(import_class(active["cpu"]), "no accelerator detected; CPU fallback", candidates, errors)
    return PlatformSelection(None, "no platform detected (is sonar-cpu installed?)", candidates, errors)


_current: type[Platform] | None = None


def current_platform() -> type[Platform]:
    """The selected platform for this process (selected once, then cached)."""
    global _current
    if _current is None:
        selection = detect_platforms()
        if selection.platform is None:
            raise RuntimeError(selection.reason)
        logger.info("platform: %s (%s)", selection.platform.name, selection.reason)
        _current = selection.platform
    return _current


def reset_platform() -> None:
    global _current
    _current = None
