"""top-p from a partial sort (the CPU fast path) keeps exactly the tokens the full sort keeps."""

from __future__ import annotations

import torch

from sonar.sampler.topk_topp import TOP_P_CANDIDATES, _top_k_top_p_by_sort, apply_top_k_top_p

VOCAB = 49152


def _mass_above_float64(logits: torch.Tensor) -> torch.Tensor:
    probs = logits.double().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    above = sorted_probs.cumsum(dim=-1) - sorted_probs
    return torch.empty_like(above).scatter_(1, order, above)


def test_partial_sort_top_p_equals_the_full_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    # peaked rows (the nucleus fits in the candidates) and flat rows (it does not: fallback)
    scales = torch.tensor([12.0, 8.0, 6.0, 4.0, 1.0, 0.2, 8.0, 12.0, 3.0, 0.5])
    logits = torch.randn(len(scales), VOCAB, generator=gen) * scales[:, None]
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.99, 0.9, 0.5, 1.0, 0.95, 0.999, 1.0])
    fast = apply_top_k_top_p(logits.clone(), None, 0, top_p)
    full = _top_k_top_p_by_sort(logits.clone(), None, top_p)
    kept_fast, kept_full = fast > float("-inf"), full > float("-inf")
    differ = kept_fast != kept_full
    if differ.any():  # only tokens sitting on the boundary, within float rounding of top_p
        above = _mass_above_float64(logits)
        assert ((above - top_p[:, None]).abs()[differ] < 1e-5).all()
    assert differ.sum() <= 2
    # rows with top_p = 1 keep every token with any probability
    assert kept_fast[6].all() and kept_fast[9].all()
    # the fast path really was taken for the peaked rows
    assert (kept_fast[0].sum() < TOP_P_CANDIDATES) and (kept_fast[4].sum() > TOP_P_CANDIDATES)
    assert torch.equal(fast[kept_fast], logits[kept_fast])
