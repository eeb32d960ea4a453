"""Mirostat v1 and v2 (Basu et al.): truncate so that the surprise of sampled tokens tracks a
target tau, with a per-request running threshold mu (kept in ``RequestSamplingState``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sonar.sampler.rows import RowValues

if TYPE_CHECKING:
    from sonar.sampler.metadata import RequestSamplingState

MIROSTAT_V1_M = 100  # tokens used to estimate the Zipf exponent
_NEG_INF = float("-inf")


@dataclass(slots=True)
class MirostatTensors:
    values: RowValues  # (mode, tau, eta, mu) per row using mirostat
    states: list["RequestSamplingState"]  # aligned with values.rows


def apply_mirostat(logits: torch.Tensor, mode: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` logits truncated by mirostat, in place.

    v2: keep the tokens whose surprise ``-log2 p`` is at most mu. v1: estimate the Zipf
    exponent s from the top ``MIROSTAT_V1_M`` probabilities (least squares of
    ``log(p_i / p_i+1)`` on ``log((i+2) / (i+1))``), then keep the top
    ``k = ((s - 1) * 2**mu / (1 - V**(1 - s))) ** (1 / s)`` tokens. The most likely token
    always stays.
    """
    vocab_size = logits.shape[1]
    probs = logits.softmax(dim=-1)
    keep_v2 = -torch.log2(probs) <= mu.unsqueeze(1)

    # v1: Zipf estimate over the top m
    m = min(MIROSTAT_V1_M, vocab_size)
    top = probs.topk(m, dim=-1).values  # [R, m]
    i = torch.arange(m - 1, device=logits.device, dtype=torch.float32)
    t = torch.log((i + 2) / (i + 1)).unsqueeze(0)  # [1, m-1]
    valid = top[:, 1:] > 0
    b = torch.where(valid, torch.log(top[:, :-1] / top[:, 1:].clamp(min=1e-38)), 0.0)
    s_hat = (t * b).sum(dim=-1) / (t * t * valid).sum(dim=-1).clamp(min=1e-30)  # [R]
    epsilon_hat = s_hat - 1
    k = ((epsilon_hat * torch.pow(2.0, mu)) / (1 - torch.pow(float(vocab_size), -epsilon_hat))).pow(1 / s_hat)
    k = torch.where(torch.isfinite(k), k, float(vocab_size)).floor().clamp(1, vocab_size)
    kth = probs.sort(dim=-1, descending=True).values.gather(1, (k.long() - 1).unsqueeze(1))
    keep_v1 = probs >= kth

    keep = torch.where((mode == 1).unsqueeze(1), keep_v1, keep_v2)
    keep.scatter_(1, probs.argmax(dim=-1, keepdim=True), True)
    return logits.masked_fill_(~keep, _NEG_INF)


def update_mirostat(mirostat: MirostatTensors, sampled_probs: torch.Tensor) -> None:
    """``mu -= eta * (-log2 p - tau)`` per row, with p the sampled token's probability
    ``[R]`` in the distribution it was drawn from."""
    surprises = (-torch.log2(sampled_probs.double())).tolist()
    for state, surprise in zip(mirostat.states, surprises):
        params = state.params
        mu = state.mirostat_mu if state.mirostat_mu is not None else 2.0 * params.mirostat_tau
        if math.isfinite(surprise):
            state.mirostat_mu = mu - params.mirostat_eta * (surprise - params.mirostat_tau)
