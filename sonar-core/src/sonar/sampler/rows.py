"""Per-row stage options for the rows that use a stage, and per-row random draws."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sonar.sampling_params import SamplingParams
from sonar.tensors import to_device


@dataclass(slots=True)
class RowValues:
    """One stage's options for the R rows of the batch that use it."""

    rows: list[int]  # batch rows using the stage, ascending
    index: torch.Tensor | None  # [R] int64 on the device; None: every row of the batch
    values: tuple[torch.Tensor, ...]  # each [R] float32 (one per option)

    def apply(self, logits: torch.Tensor, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``fn(rows_logits, *values)`` on the selected rows of ``logits`` ``[B, V]``; the
        result is written back (in place when only some rows use the stage)."""
        if self.index is None:
            return fn(logits, *self.values)
        logits[self.index] = fn(logits[self.index], *self.values)
        return logits


def build_row_values(
    params: Sequence[SamplingParams],
    pick: Callable[[SamplingParams], tuple[float, ...] | None],
    device: torch.device,
    skip: Sequence[bool] | None = None,
) -> RowValues | None:
    """Collect ``pick(params)`` for each row where it is not None (and ``skip`` is not set).

    :returns: None when no row uses the stage: the sampler then skips it.
    """
    rows: list[int] = []
    columns: list[tuple[float, ...]] = []
    for row, p in enumerate(params):
        if skip is not None and skip[row]:
            continue
        picked = pick(p)
        if picked is not None:
            rows.append(row)
            columns.append(picked)
    if not rows:
        return None
    return row_values(rows, columns, len(params), device)


def row_values(rows: list[int], columns: list[tuple[float, ...]], num_rows: int, device: torch.device) -> RowValues:
    """``RowValues`` for ``rows`` (ascending) of a batch of ``num_rows``, one tuple of options each."""
    values = to_device(torch.tensor(columns, dtype=torch.float32).T.contiguous(), device)  # [num_values, R]
    index = None if len(rows) == num_rows else to_device(torch.tensor(rows, dtype=torch.int64), device)
    return RowValues(rows=rows, index=index, values=tuple(values))


def row_uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``[R]`` uniform draws in [0, 1): from each row's own generator where seeded (one draw),
    from the global generator for the others."""
    draws = torch.rand(len(generators), device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            draws[i] = torch.rand(1, device=device, generator=generator)[0]
    return draws


def row_exponentials(
    shape: tuple[int, int], generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """``[B, V]`` Exp(1) draws; each row in ``generators`` from its own generator."""
    q = torch.empty(shape, device=device).exponential_()
    for row, generator in generators.items():
        q[row] = torch.empty(shape[1], device=device).exponential_(generator=generator)
    return q
