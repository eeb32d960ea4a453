"""The lossless verifier: which draft tokens the target model keeps, and the token it adds.

Each verified request scores ``k`` drafts plus one bonus position in one forward pass. At
draft position ``j`` the target's distribution ``p_j`` (the request's whole sampling pipeline
applied to that position's logits) decides:

- greedy requests keep a draft while it is the argmax of ``p_j``; the first disagreement is
  replaced by the argmax, and when all ``k`` agree the bonus position's argmax is added;
- sampled requests keep draft ``d`` with probability ``min(1, p_j(d) / q_j(d))`` (``q_j`` the
  draft's distribution; for a proposer without one, such as n-gram, ``q_j`` is one-hot at
  ``d`` and the test is ``p_j(d)``); the first rejected position draws instead from the
  residual ``max(p_j - q_j, 0)`` renormalised (one-hot: ``p_j`` with ``d`` removed), and when
  all ``k`` are kept the bonus token is drawn from ``p_k``.

Either way each emitted token is distributed exactly as plain decoding would draw it.
Randomness comes from the request's own generator where it is seeded, so a seeded request
is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar import ops
from sonar.sampler.rows import row_exponentials
from sonar.tensors import to_device


@dataclass(slots=True)
class VerifyLayout:
    """Where each request's positions sit among the ``P`` verified positions.

    Request ``i`` owns positions ``starts[i] .. starts[i] + num_drafts[i]`` (its drafts, then
    its bonus position). On the device, built at first use (a greedy batch never needs them):
    ``row_of`` / ``offset`` map each position to its request and its index inside it;
    ``draft_ids`` holds each position's draft (-1 at bonus positions).
    """

    drafts: list[list[int]]
    num_drafts: list[int]
    starts: list[int]
    device: torch.device
    _tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> VerifyLayout:
        """The layout of requests proposing ``drafts`` (an empty list: a plain decode)."""
        num_drafts = [len(d) for d in drafts]
        starts, position = [], 0
        for count in num_drafts:
            starts.append(position)
            position += count + 1
        return cls(drafts, num_drafts, starts, device)

    @property
    def num_positions(self) -> int:
        return self.starts[-1] + self.num_drafts[-1] + 1 if self.starts else 0

    @property
    def row_of(self) -> torch.Tensor:  # [P] int64
        return self._device_tensors()[0]

    @property
    def offset(self) -> torch.Tensor:  # [P] int64
        return self._device_tensors()[1]

    @property
    def draft_ids(self) -> torch.Tensor:  # [P] int64
        return self._device_tensors()[2]

    def _device_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tensors is None:
            row_of, offset, draft_ids = [], [], []
            for row, tokens in enumerate(self.drafts):
                count = len(tokens) + 1
                row_of += [row] * count
                offset += range(count)
                draft_ids += [*tokens, -1]
            # pinned: a pageable copy would make the host wait for the forward pass still running
            as_tensor = lambda values: to_device(torch.tensor(values, dtype=torch.int64), self.device)
            self._tensors = (as_tensor(row_of), as_tensor(offset), as_tensor(draft_ids))
        return self._tensors

    def leading_matches(self, token_ids: list[int]) -> list[int]:
        """Per request, how many of its drafts lead its emitted positions (``token_ids``: one
        per position) unchanged: the drafts a greedy verification keeps, where the emitted
        token is the argmax at every position."""
        counts = []
        for start, tokens in zip(self.starts, self.drafts):
            kept = 0
            for draft in tokens:
                if token_ids[start + kept] != draft:
                    break
                kept += 1
            counts.append(kept)
        return counts


@dataclass(slots=True)
class VerifyResult:
    """``token_ids[p]`` is the token emitted at position ``p`` (valid for the first
    ``num_accepted[i] + 1`` positions of request ``i``); ``num_accepted[i]`` how many of its
    drafts were kept. ``num_accepted`` is None where ``token_ids`` holds the argmax at every
    position (an all-greedy batch): the host counts the kept drafts
    (``VerifyLayout.leading_matches``) from the tokens it reads back anyway."""

    token_ids: torch.Tensor  # [P] int64
    num_accepted: torch.Tensor | None  # [B] int64


def verify(
    probs: torch.Tensor | None,
    greedy_ids: torch.Tensor | None,
    greedy_rows: torch.Tensor | None,
    layout: VerifyLayout,
    generators: dict[int, torch.Generator],
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Accept or reject every draft of a batch at once.

    :param probs: ``[P, V]`` the target's final sampling distribution at each position (None:
        every request is greedy).
    :param greedy_ids: ``[P]`` the argmax of the processed logits at each position (None:
        every request samples).
    :param greedy_rows: ``[B]`` bool, which requests are greedy, for a batch of both kinds
        (None: all of one kind).
    :param layout: the positions of each request.
    :param generators: request row -> its seeded generator.
    :param draft_probs: ``[P, V]`` the draft's distribution at each position (rows of bonus
        positions unused); None: drafts are one-hot (proposers without probabilities).
    """
    draft_ids = layout.draft_ids
    is_draft = draft_ids >= 0
    safe_drafts = draft_ids.clamp(min=0)
    accepted = alternative = None
    if probs is not None:
        accepted, alternative = _sampled_decisions(probs, layout, generators, draft_probs, is_draft, safe_drafts)
    if greedy_ids is not None:
        greedy_accepted = is_draft & (greedy_ids == draft_ids)
        if accepted is None:
            accepted, alternative = greedy_accepted, greedy_ids
        else:
            greedy_at = greedy_rows[layout.row_of]
            accepted = torch.where(greedy_at, greedy_accepted, accepted)
            alternative = torch.where(greedy_at, greedy_ids, alternative)
    num_accepted = leading_accepted(accepted, layout)
    keep_draft = layout.offset < num_accepted[layout.row_of]
    return VerifyResult(torch.where(keep_draft, draft_ids, alternative), num_accepted)


def _sampled_decisions(
    probs: torch.Tensor,
    layout: VerifyLayout,
    generators: dict[int, torch.Generator],
    draft_probs: torch.Tensor | None,
    is_draft: torch.Tensor,
    safe_drafts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: whether its draft passes the rejection test, and the token drawn in its
    place (from the residual at a draft position, from ``p`` at a bonus position)."""
    num_positions = probs.shape[0]
    target_p = probs.gather(1, safe_drafts[:, None])[:, 0]
    if draft_probs is None:
        ratio = target_p
        residual = probs.scatter(1, safe_drafts[:, None], 0.0)
    else:
        draft_p = draft_probs.gather(1, safe_drafts[:, None])[:, 0]
        ratio = target_p / draft_p.clamp(min=torch.finfo(probs.dtype).tiny)
        residual = (probs - draft_probs).clamp(min=0.0)
    residual = torch.where(is_draft[:, None], residual, probs)
    # a residual that is all zero (p == q) is never drawn from: the draft is then always kept
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    position_generators = {
        position: generators[row]
        for row, start in enumerate(layout.starts)
        if row in generators
        for position in range(start, start + layout.num_drafts[row] + 1)
    }
    uniforms = _position_uniforms(num_positions, position_generators, probs.device)
    accepted = is_draft & (uniforms < ratio)
    exponentials = row_exponentials(tuple(probs.shape), position_generators, probs.device)
    alternative = ops.argmax(residual / exponentials)  # the exponential race: a draw from the renormalised residual
    return accepted, alternative


def _position_uniforms(count: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    draws = torch.rand(count, device=device)
    for position, generator in generators.items():
        draws[position] = torch.rand(1, device=device, generator=generator)[0]
    return draws


def leading_accepted(accepted: torch.Tensor, layout: VerifyLayout) -> torch.Tensor:
    """``[B]`` how many drafts of each request are kept: its run of accepted positions from the first."""
    num_rows = len(layout.starts)
    width = max(layout.num_drafts) + 1
    grid = torch.zeros(num_rows, width, dtype=torch.bool, device=accepted.device)
    grid[layout.row_of, layout.offset] = accepted
    return grid.to(torch.int64).cumprod(dim=1).sum(dim=1)


def first_logits_rows(drafts: list[list[int]]) -> list[int]:
    """The logits row of each request's first verified position (``drafts[i]``: its drafts)."""
    rows, position = [], 0
    for tokens in drafts:
        rows.append(position)
        position += len(tokens) + 1
    return rows
