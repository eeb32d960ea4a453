"""The batched products every LoRA layer runs, with a seam for platform kernels.

A layer with ``S`` adapter slots holds its adapters stacked: ``a [S, N, in]`` (the A matrices
of its ``P`` fused parts, each zero-padded to rank ``R``, so ``N = P * R``) and
``b [S, out, R]`` (the B matrices, the adapter's scale folded in; part ``p`` fills its own
output rows). ``token_slots [T]`` (int32) names each token's slot, ``-1`` for none.

:func:`lora_shrink_expand` is the two in one call (what a layer runs): a platform may fuse
them for few tokens, where the launches, not the bytes, cost the time.

:func:`lora_linear_shrink` lets a platform compute an unquantized layer's base product and the
shrink in one launch (at one row, where launches cost the time); :func:`lora_shrink_begin`
lets it start the shrink before the layer's base product, to run beside it (on a second
stream, say). Without either, the shrink follows the product.

The operations are registered like any other (``sonar.ops.declare_op``): a platform puts a
kernel behind ``"lora_shrink"``, ``"lora_expand"``, ``"lora_shrink_expand"``,
``"lora_shrink_begin"`` and ``"lora_linear_shrink"``, and the
torch versions below run elsewhere (the torch ``lora_shrink_expand`` calls the other two, so
a platform with only those two kernels still runs them). Kernels must not read
``token_slots`` on the host (CUDA graphs capture them).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sonar import ops

ops.declare_op("lora_shrink")
ops.declare_op("lora_expand")
ops.declare_op("lora_shrink_expand")
ops.declare_op("lora_shrink_begin")
ops.declare_op("lora_linear_shrink")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] @ a[token_slots[t]].T`` for ``x [T, in]``: ``[T, N]`` float32, zero where
    ``token_slots[t] == -1``."""
    impl = ops.platform_op(x, "lora_shrink")
    if impl is not None:
        return impl(x, a, token_slots)
    return torch_lora_shrink(x, a, token_slots)


def lora_shrink_begin(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """Start :func:`lora_shrink` of ``x`` before the layer's base product is launched, where
    the platform can run the two side by side. Returns the function that waits for the shrink
    and gives its ``y`` (call it before using ``y`` in :func:`lora_expand`); None where the
    platform cannot overlap them (the default): the caller then runs
    :func:`lora_shrink_expand` after the product."""
    impl = ops.platform_op(x, "lora_shrink_begin")
    return impl(x, a, token_slots) if impl is not None else None


def lora_linear_shrink(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x @ weight.T (+ bias), lora_shrink(x, a, token_slots))`` computed together where the
    platform has one kernel for both (an unquantized weight, few rows); None where it has not
    (the default): the caller then runs the product and the shrink apart."""
    impl = ops.platform_op(x, "lora_linear_shrink")
    return impl(x, weight, bias, a, token_slots) if impl is not None else None


def lora_expand(
    y: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor, part_rows: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """``out[t, r0:r1] += y[t, p*R:(p+1)*R] @ b[token_slots[t], r0:r1].T`` for every part ``p``
    with rows ``part_rows[p] = (r0, r1)`` (``R = b.shape[-1]``), in ``out``'s dtype, in place;
    tokens with slot ``-1`` are left as they are. Returns ``out``."""
    impl = ops.platform_op(out, "lora_expand")
    if impl is not None:
        return impl(y, b, token_slots, out, part_rows)
    return torch_lora_expand(y, b, token_slots, out, part_rows)


def lora_shrink_expand(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    part_rows: tuple[tuple[int, int], ...],
) -> torch.Tensor:
    """:func:`lora_shrink` then :func:`lora_expand`: ``out[t, r0:r1] += (x[t] @
    a[slot, p*R:(p+1)*R].T) @ b[slot, r0:r1].T`` (``slot = token_slots[t]``) for every part
    ``p``, in place; tokens with slot ``-1`` are left as they are. Returns ``out``. A
    platform's kernel may compute it in one launch, without rounding the intermediate."""
    impl = ops.platform_op(out, "lora_shrink_expand")
    if impl is not None:
        return impl(x, a, b, token_slots, out, part_rows)
    return lora_expand(lora_shrink(x, a, token_slots), b, token_slots, out, part_rows)


def slot_segments(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """``(slot, rows)`` for every slot the tokens use (-1 left out): a request's tokens are
    contiguous, so rows are slices where the runs are few, else index tensors per slot. Reads
    ``token_slots`` on the host (the torch versions are never captured in a graph)."""
    slots = token_slots.cpu().numpy()
    if not len(slots):
        return []
    starts = np.flatnonzero(np.diff(slots)) + 1
    bounds = [0, *starts.tolist(), len(slots)]
    runs = [(int(slots[s]), s, e) for s, e in zip(bounds[:-1], bounds[1:]) if slots[s] >= 0]
    distinct = {slot for slot, _, _ in runs}
    if len(runs) <= 2 * len(distinct):
        return [(slot, slice(s, e)) for slot, s, e in runs]
    rows = torch.from_numpy(slots).to(token_slots.device)
    return [(slot, (rows == slot).nonzero(as_tuple=True)[0]) for slot in sorted(distinct)]


def torch_lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    y = x.new_zeros((x.shape[0], a.shape[1]), dtype=torch.float32)
    for slot, rows in slot_segments(token_slots):
        y[rows] = (x[rows] @ a[slot].T).float()
    return y


def torch_lora_expand(
    y: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor, part_rows: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    rank = b.shape[-1]
    for slot, rows in slot_segments(token_slots):
        shrunk = y[rows].to(b.dtype)
        for p, (r0, r1) in enumerate(part_rows):
            delta = shrunk[:, p * rank : (p + 1) * rank] @ b[slot, r0:r1].T
            out[rows, r0:r1] += delta.to(out.dtype)
    return out
