"""Logprobs of chosen tokens plus the top-k alternatives, from raw model logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, k+1] int64: column 0 is the sampled/target token, then top-k
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N] int64: 1-based rank of the column-0 token in the vocabulary

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """The three tensors as Python lists (one device-to-host copy each)."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-softmax ``logits`` and gather the logprob and rank of ``token_ids`` plus the top ``k``.

    Used for sampled tokens (``token_ids`` = the sampled ones) and prompt logprobs
    (``token_ids`` = the next prompt token at each position).

    :param logits: ``[N, V]`` raw model logits (any float dtype; computed in float32).
    :param token_ids: ``[N]`` int64, the token whose logprob goes in column 0.
    :param k: number of top alternatives (0: only column 0).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    if k <= 0:
        return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [N, k]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([chosen, top_logprobs], dim=1),
        ranks=ranks,
    )
