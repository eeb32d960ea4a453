"""The NVIDIA CUDA platform."""

from __future__ import annotations

import torch

from sonar.platform import Platform


class CudaPlatform(Platform):
    """NVIDIA GPUs through CUDA: Triton attention kernels, NCCL for multi-GPU runs."""

    name = "cuda"
    device_type = "cuda"
    worker_cls = "sonar_cuda.worker:CudaWorker"
    attention_backend_cls = "sonar_cuda.attention:TritonAttentionBackend"
    ops_module = "sonar_cuda.ops"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")  # fp8_e4m3: scaled per layer; fp8_e5m2: unscaled; see the attention backend
    dist_backend = "nccl"
    async_scheduling = True  # kernels are queued: the host schedules step N+1 while step N runs

    @classmethod
    def replica_env(cls, index: int, num_replicas: int, ranks_per_replica: int = 1) -> dict[str, str]:
        """Replica ``index`` sees only its ``ranks_per_replica`` GPUs of those visible to the
        server: ``index * ranks .. index * ranks + ranks - 1`` (its tensor-parallel ranks use
        ``cuda:0 ..`` of them)."""
        if num_replicas == 1:
            return {}
        import os

        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if not visible:
            visible = [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        needed = num_replicas * ranks_per_replica
        if len(visible) < needed:
            group = f" x {ranks_per_replica} ranks each" if ranks_per_replica > 1 else ""
            raise ValueError(f"data_parallel_size={num_replicas}{group} needs {needed} GPUs; {len(visible)} are visible")
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible[index * ranks_per_replica : (index + 1) * ranks_per_replica])}

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        """The CUDA device for local rank ``index``."""
        return torch.device("cuda", index)

    @classmethod
    def total_memory_bytes(cls) -> int:
        """Memory of the current device, as the driver reports it."""
        return torch.cuda.mem_get_info()[1]

    @classmethod
    def available_memory_bytes(cls) -> int:
        """Free memory of the current device right now (other processes' use counted too)."""
        return torch.cuda.mem_get_info()[0]

    measures_memory = True

    @classmethod
    def reset_peak_memory(cls) -> None:
        """Start a new peak measurement of the caching allocator."""
        torch.cuda.reset_peak_memory_stats()

    @classmethod
    def allocated_memory_bytes(cls) -> int:
        """Bytes the caching allocator holds on the current device (reserved: what tensors
        use plus the blocks it keeps cached, as the device sees it)."""
        return torch.cuda.memory_reserved()

    @classmethod
    def peak_memory_bytes(cls) -> int:
        """The allocator's peak of reserved bytes since ``reset_peak_memory``."""
        return torch.cuda.max_memory_reserved()

    @classmethod
    def release_cached_memory(cls) -> None:
        """Return the allocator's cached, unused blocks to the driver."""
        torch.cuda.empty_cache()

    @classmethod
    def describe(cls) -> str:
        """``cuda: NVIDIA H200 (sm_90), 139.8 GiB`` for ``sonar plugins``."""
        major, minor = torch.cuda.get_device_capability()
        total_gib = cls.total_memory_bytes() / 2**30
        return f"cuda: {torch.cuda.get_device_name()} (sm_{major}{minor}), {total_gib:.1f} GiB"

    @classmethod
    def synchronize(cls) -> None:
        """Wait for all work queued on the current device."""
        torch.cuda.synchronize()
