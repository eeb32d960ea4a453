"""The tensor-parallel group a model is built for, and the communicator its layers reduce through.

A worker of a parallel run joins ``torch.distributed`` (``init_distributed``) and builds its
model inside ``building_for(group)``; every layer that shards asks ``current_group()`` once,
when it is constructed, and keeps the group it got. Outside that context (one device, a model
built by hand in a test) the group is the single rank, whose collectives do nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0  # a collective waiting this long on a rank gives up


class Communicator:
    """The collectives tensor-parallel layers use, over a ``torch.distributed`` process group.

    Platforms may subclass it (``Platform.communicator_cls``) to run collectives through their
    own kernels; this one calls ``torch.distributed`` on ``group`` (None: the default group,
    every rank). ``send`` / ``recv`` carry a tensor between two ranks (by global rank): the
    hand-over between pipeline stages.
    """

    def __init__(self, world_size: int, group: Any = None) -> None:
        self.world_size = world_size
        self.group = group  # a torch.distributed process group (None: the default one)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the ranks (may reuse ``x``'s memory)."""
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, x: torch.Tensor, dst: int) -> Any:
        """Start sending ``x`` to global rank ``dst``; returns a handle whose ``wait()`` returns
        once ``x`` may be reused."""
        return torch.distributed.isend(x.contiguous(), dst)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``x`` with what global rank ``src`` sends (waits for it)."""
        torch.distributed.recv(x, src)
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` exchanged between the ranks: the first ``send_counts[0]`` rows go to
        rank 0, the next ``send_counts[1]`` to rank 1, and so on; returns the rows each rank
        sent this one, in rank order, ``[sum(recv_counts), *x.shape[1:]]``. ``recv_counts[r]``
        (how many rows rank ``r`` sends here) comes from :meth:`all_to_all_counts`; counts may
        be zero. Gloo and NCCL both take uneven splits (``all_to_all_single``)."""
        if self.world_size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        torch.distributed.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group
        )
        return out

    def all_to_all_counts(self, send_counts: torch.Tensor) -> list[int]:
        """How many rows each rank will send this one, given ``send_counts [world_size]`` (an
        integer tensor on the collectives' device: the rows this rank sends each rank). One
        small all-to-all, read on the host: what :meth:`all_to_all` needs to size its output."""
        if self.world_size == 1:
            return send_counts.tolist()
        recv_counts = torch.empty_like(send_counts)
        torch.distributed.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        return recv_counts.tolist()


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """One rank's place in a tensor-parallel group and the communicator it reduces through.

    ``expert_parallel``: mixture-of-experts layers give each rank whole experts (``E / N``
    each, tokens exchanged with all-to-all) instead of every expert's slice of the
    intermediate dimension.
    """

    rank: int = 0
    world_size: int = 1
    communicator: Communicator = field(default_factory=lambda: Communicator(1))
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def shard(self, size: int, what: str) -> int:
        """This rank's share of ``size`` (heads, rows, columns), which must divide evenly."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size={self.world_size}; "
                f"choose a tensor_parallel_size that divides it"
            )
        return size // self.world_size


SINGLE_RANK = ParallelGroup()
_building_for: contextvars.ContextVar[ParallelGroup] = contextvars.ContextVar("sonar_parallel_group", default=SINGLE_RANK)


@contextlib.contextmanager
def building_for(group: ParallelGroup) -> Iterator[None]:
    """Models built inside this context shard their layers for ``group``."""
    token = _building_for.set(group)
    try:
        yield
    finally:
        _building_for.reset(token)


def current_group() -> ParallelGroup:
    """The group a layer built now shards for (the single rank outside ``building_for``)."""
    return _building_for.get()


def init_distributed(
    platform: type, rank: int, world_size: int, init_method: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    local_rank: int | None = None,
) -> ParallelGroup:
    """Join the ``torch.distributed`` group of ``world_size`` ranks as ``rank`` (rendezvous at
    ``init_method``, ``tcp://host:port``) with the platform's backend, and return this rank's
    ``ParallelGroup`` with the platform's communicator. ``local_rank``: the rank's place on
    its host, which picks its device (default ``rank``: every rank on one host)."""
    from sonar.registry import import_class

    backend = platform.dist_backend
    device_index = rank if local_rank is None else local_rank
    options = {"device_id": platform.device(device_index)} if platform.device_type != "cpu" else {}
    torch.distributed.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s), **options,
    )
    communicator_cls = import_class(platform.communicator_cls)
    return ParallelGroup(rank, world_size, communicator_cls(world_size))
