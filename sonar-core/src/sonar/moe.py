"""The expert computation of a mixture-of-experts layer, with a seam for platform kernels.

A layer's ``E`` experts are SiLU-gated MLPs stacked into two tensors: ``w13 [E, 2 * I, H]``
(each expert's gate rows, then its up rows) and ``w2 [E, H, I]`` (its down projection). The
router has already chosen, per token, ``k`` experts ``topk_ids [T, k]`` and their weights
``topk_weights [T, k]``; :func:`fused_moe` returns

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

A platform registers a kernel behind ``"fused_moe"`` (``sonar.ops.declare_op``); the torch
version below runs elsewhere: the ``T * k`` (token, expert) pairs sorted by expert, one pair
of products per expert that has tokens. Kernels must not read ``topk_ids`` on the host (CUDA
graphs capture them).

A platform may also register ``"fused_moe_fp8"``, taking ``(x, w13, w2, w13_scale, w2_scale,
topk_weights, topk_ids, expert_map=None, block=None)``: the same sum over FP8 experts (``w13``,
``w2`` in float8_e4m3fn) whose output rows are multiplied by float32 scales ``w13_scale [E, 2I]``
and ``w2_scale [E, H]``, the activations left in ``x``'s dtype (W8A16). With ``block``
``(bn, bk)`` the scales are per block of a weight instead: ``w13_scale [E, 2 ceil(I / bn),
ceil(H / bk)]`` (each expert's gate block rows, then its up block rows) and ``w2_scale
[E, ceil(H / bn), ceil(I / bk)]``. FP8 checkpoints' experts use it where it is registered
(``sonar.quantization.fp8``).

Under expert parallelism a rank holds only some of the experts: ``w13`` and ``w2`` stack its
``E_local`` experts, and ``expert_map [E]`` (int32) gives each global expert id its local
index, or -1 where another rank holds it. The (token, expert) pairs routed to an expert held
elsewhere contribute nothing to this rank's output.
"""

from __future__ import annotations

from typing import Callable

import torch

from sonar import ops

ops.declare_op("fused_moe")
ops.declare_op("fused_moe_fp8")


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted sum over each token's chosen experts, ``[T, H]`` in ``x``'s dtype.

    :param x: ``[T, H]`` activations.
    :param w13: ``[E, 2 * I, H]`` gate and up projections, stacked per expert.
    :param w2: ``[E, H, I]`` down projections.
    :param topk_weights: ``[T, k]`` routing weights (any floating dtype; products are weighted
        in float32).
    :param topk_ids: ``[T, k]`` expert indices in ``0 .. E - 1`` (any integer dtype).
    :param expert_map: ``[E]`` int32, global expert id -> index into ``w13`` / ``w2``, -1 for
        an expert this rank does not hold (None: ``w13`` and ``w2`` hold every expert).
    """
    impl = ops.platform_op(x, "fused_moe")
    if impl is not None:
        if expert_map is None:
            return impl(x, w13, w2, topk_weights, topk_ids)
        return impl(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map)
    return torch_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map)


def check_moe_shapes(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` unless the five tensors fit together as :func:`fused_moe` takes them."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if hidden != x.shape[1] or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]")
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"expert_map must be [E] (global expert id -> local index or -1), got {tuple(expert_map.shape)}")


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int) -> torch.Tensor:
    """``topk_ids`` as indices into this rank's experts: ``expert_map`` applied, and every
    expert held elsewhere (-1) replaced by ``num_local_experts`` (no expert: the pair is
    dropped). Unchanged without a map. Runs on the device (no host read)."""
    if expert_map is None:
        return topk_ids
    local = expert_map.to(topk_ids.device)[topk_ids.long()]
    return torch.where(local < 0, num_local_experts, local).to(torch.int32)


def torch_fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_moe` in torch: pairs grouped by expert, two products per active expert
    (pairs of experts held elsewhere sort last and are left out)."""
    check_moe_shapes(x, w13, w2, topk_weights, topk_ids, expert_map)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = torch.nn.functional.linear(rows, w13[expert]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])

    return experts_by_group(x, topk_weights, topk_ids, expert_map, w13.shape[0], expert_mlp)


def experts_by_group(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
    num_local_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
    grouped_mlp: Callable[[torch.Tensor, list[int]], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """:func:`fused_moe`'s weighted sum with each local expert's MLP given as
    ``expert_mlp(local expert, its rows of x) -> [rows, H]``, called once per expert that has
    tokens (the routing is read on the host: not for CUDA graphs). ``grouped_mlp(rows of x
    grouped by expert, rows per local expert)``, where given, is tried first for all experts at
    once (None: it does not take them, and ``expert_mlp`` runs)."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = local_expert_ids(topk_ids, expert_map, num_local_experts).reshape(-1).long()  # [T * k], pair p = (token p // k, slot p % k)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, those held elsewhere last
    counts = torch.bincount(flat_ids, minlength=num_local_experts + 1).tolist()[:num_local_experts]
    order = order[: sum(counts)]
    tokens = order // top_k
    grouped_x = x[tokens]  # [pairs, H]
    grouped_out = grouped_mlp(grouped_x, counts) if grouped_mlp is not None else None
    if grouped_out is None:
        grouped_out = torch.empty_like(grouped_x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                grouped_out[start : start + count] = expert_mlp(expert, grouped_x[start : start + count])
                start += count
    weights = topk_weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, grouped_out.float() * weights)
    return out.to(x.dtype)
