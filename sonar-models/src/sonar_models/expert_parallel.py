"""Expert parallelism: which experts a rank holds, and tokens sent to them and back.

With ``expert_parallel`` set on the tensor-parallel group (``sonar.distributed.ParallelGroup``),
each of the ``N`` ranks holds ``E / N`` whole experts of every sparse layer: rank ``r`` experts
``r * E / N`` up to ``(r + 1) * E / N``. Attention stays tensor-parallel, so every rank enters a
sparse layer with the same ``T`` tokens; each takes its own slice of them (``token_slice``),
routes it, and :func:`run_experts_across_ranks` sends each token to the ranks that hold its
chosen experts (all-to-all), runs the tokens it received through its local experts and sends
the partial sums back. The block then puts each rank's slice in place and one all-reduce
(shared with the shared expert's partial sums) gives every rank all ``T`` rows again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.distributed import ParallelGroup


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """The experts of one sparse layer a rank holds: global ids ``first .. first + count - 1``
    of ``num_experts``."""

    num_experts: int
    first: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.first <= self.first + self.count <= self.num_experts:
            raise ValueError(f"experts {self.first}..{self.first + self.count - 1} are outside 0..{self.num_experts - 1}")

    @property
    def is_partial(self) -> bool:
        """Whether other ranks hold some of the experts."""
        return self.count < self.num_experts

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def expert_map(self) -> torch.Tensor:
        """``[num_experts]`` int32: global id -> local index, -1 where another rank holds it."""
        local = torch.full((self.num_experts,), -1, dtype=torch.int32)
        local[self.first : self.first + self.count] = torch.arange(self.count, dtype=torch.int32)
        return local


def expert_placement(num_experts: int, group: ParallelGroup) -> ExpertPlacement:
    """This rank's experts: all of them unless the group is expert-parallel, else its
    ``num_experts / world_size`` consecutive ones (which must divide evenly)."""
    ranks = group.world_size
    if ranks == 1 or not group.expert_parallel:
        return ExpertPlacement(num_experts, 0, num_experts)
    if num_experts % ranks:
        raise ValueError(
            f"expert parallelism gives each of the {ranks} ranks the same number of whole experts, but the model has "
            f"{num_experts} experts per layer; choose a tensor_parallel_size that divides {num_experts}, or leave "
            f"enable_expert_parallel off (each expert's intermediate size is then split over the ranks)"
        )
    count = num_experts // ranks
    return ExpertPlacement(num_experts, group.rank * count, count)


def token_slice(num_tokens: int, group: ParallelGroup) -> slice:
    """The rows of a step's ``num_tokens`` this rank routes: consecutive, as even as they
    split (the first ``num_tokens % world_size`` ranks one more; a rank may get none)."""
    base, extra = divmod(num_tokens, group.world_size)
    start = group.rank * base + min(group.rank, extra)
    return slice(start, start + base + (group.rank < extra))


def run_experts_across_ranks(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: torch.nn.Module, experts_per_rank: int,
    group: ParallelGroup,
) -> torch.Tensor:
    """``[T, H]``: the weighted sum of each of this rank's tokens' chosen experts, wherever
    they are held.

    Dispatch: a token goes once to every rank holding one of its experts (its row of ``x``,
    its ``topk_ids`` and ``topk_weights``), the counts exchanged first. Each rank runs what it
    received through ``experts`` (which apply only its own experts: the others' choices add
    nothing there). Combine: the partial sums go back the same way and are added per token.
    Reads the counts on the host (the split sizes), so it is not captured in CUDA graphs.
    """
    communicator, num_ranks = group.communicator, group.world_size
    num_tokens = x.shape[0]
    owners = topk_ids.long() // experts_per_rank  # [T, k] the rank holding each choice
    goes_to = torch.zeros((num_tokens, num_ranks), dtype=torch.bool, device=x.device)
    goes_to.scatter_(1, owners, True)  # [T, ranks]
    _, tokens = goes_to.t().nonzero(as_tuple=True)  # grouped by destination rank, tokens in order
    send_counts = goes_to.sum(dim=0)
    recv_counts = communicator.all_to_all_counts(send_counts)
    send = send_counts.tolist()
    # dispatch
    x_in = communicator.all_to_all(x[tokens], send, recv_counts)
    ids_in = communicator.all_to_all(topk_ids[tokens], send, recv_counts)
    weights_in = communicator.all_to_all(topk_weights[tokens], send, recv_counts)
    partial = experts(x_in, weights_in, ids_in)  # [received, H]
    # combine
    returned = communicator.all_to_all(partial, recv_counts, send)  # [sent, H], in the order sent
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, returned.float())
    return out.to(x.dtype)
