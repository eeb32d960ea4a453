"""The extra truncation and shaping samplers against plain per-request references of their
published definitions, on random logits: same kept set, same renormalised probabilities."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from sonar.sampler import RequestSamplingState, Sampler, SamplingMetadata
from sonar.sampling_params import SamplingParams

VOCAB = 300
CPU = torch.device("cpu")


def make_state(params: SamplingParams, output: list[int] | None = None, mu: float | None = None) -> RequestSamplingState:
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return RequestSamplingState(
        params=params, prompt_token_ids=[1, 2, 3], output_token_ids=list(output or []), generator=generator,
        eos_token_ids=[0], mirostat_mu=mu,
    )  # fmt: skip


def random_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def sampler_probs(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    return Sampler().probabilities(logits, SamplingMetadata.build(states, logits.shape[1], CPU))


# --- plain references (float64, one row, written from the papers' descriptions) --------------


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def renormalised(probs: list[float], keep: list[bool]) -> torch.Tensor:
    kept = [p if k else 0.0 for p, k in zip(probs, keep)]
    total = sum(kept)
    return torch.tensor([p / total for p in kept], dtype=torch.float64)


def entropy(probs: list[float]) -> float:
    return -sum(p * math.log(p) for p in probs if p > 0)


def ref_top_a(row: list[float], a: float) -> torch.Tensor:
    probs = softmax(row)
    limit = a * max(probs) ** 2
    return renormalised(probs, [p >= limit for p in probs])


def ref_tfs(row: list[float], z: float) -> torch.Tensor:
    probs = softmax(row)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    sp = [probs[i] for i in order]
    first = [sp[i + 1] - sp[i] for i in range(len(sp) - 1)]
    second = [abs(first[i + 1] - first[i]) for i in range(len(first) - 1)]
    total = sum(second)
    cdf, running = [], 0.0
    for value in second:
        running += value / total
        cdf.append(running)
    keep = [False] * len(probs)
    for j, token in enumerate(order):
        keep[token] = j == 0 or (j < len(order) - 1 and cdf[j - 1] <= z)
    return renormalised(probs, keep)


def ref_typical(row: list[float], mass: float) -> torch.Tensor:
    probs = softmax(row)
    h = entropy(probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - h) if probs[i] > 0 else math.inf)
    keep, running = [False] * len(probs), 0.0
    for token in order:
        keep[token] = True
        running += probs[token]
        if running >= mass:
            break
    return renormalised(probs, keep)


def ref_eta(row: list[float], eta: float) -> torch.Tensor:
    probs = softmax(row)
    eps = eta * 1e-4
    limit = min(eps, math.sqrt(eps) * math.exp(-entropy(probs)))
    top = max(range(len(probs)), key=probs.__getitem__)
    return renormalised(probs, [p >= limit or i == top for i, p in enumerate(probs)])


def ref_epsilon(row: list[float], epsilon: float) -> torch.Tensor:
    probs = softmax(row)
    top = max(range(len(probs)), key=probs.__getitem__)
    return renormalised(probs, [p >= epsilon * 1e-4 or i == top for i, p in enumerate(probs)])


def ref_nsigma(row: list[float], n: float) -> torch.Tensor:
    mean = sum(row) / len(row)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
    probs = softmax(row)
    return renormalised(probs, [x >= max(row) - n * sigma for x in row])


def ref_quadratic(row: list[float], factor: float, curve: float) -> torch.Tensor:
    top = max(row)
    k, s = (3 - curve) / 2, (curve - 1) / 2
    shaped = [top - k * factor * (x - top) ** 2 + s * factor * (x - top) ** 3 for x in row]
    return torch.tensor(softmax(shaped), dtype=torch.float64)


def ref_dynatemp(row: list[float], low: float, high: float, exponent: float) -> torch.Tensor:
    probs = softmax(row)
    normalised = entropy(probs) / math.log(len(row))
    temperature = low + (high - low) * normalised**exponent
    return torch.tensor(softmax([x / temperature for x in row]), dtype=torch.float64)


def ref_xtc(row: list[float], threshold: float) -> torch.Tensor:
    probs = softmax(row)
    above = [i for i, p in enumerate(probs) if p >= threshold]
    keep = [True] * len(probs)
    if len(above) >= 2:
        least = min(above, key=probs.__getitem__)
        for i in above:
            keep[i] = i == least
    return renormalised(probs, keep)


def ref_skew(row: list[float], skew: float) -> torch.Tensor:
    probs = softmax(row)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    out, previous, running = [0.0] * len(probs), 0.0, 0.0
    for token in order:
        running += probs[token]
        current = min(running, 1.0) ** math.exp(skew)
        out[token] = current - previous
        previous = current
    return torch.tensor(out, dtype=torch.float64)


def ref_mirostat(row: list[float], mode: int, mu: float) -> torch.Tensor:
    probs = softmax(row)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if mode == 2:
        keep = [-math.log2(p) <= mu if p > 0 else False for p in probs]
    else:
        sp = [probs[i] for i in order]
        m = min(100, len(sp))
        num = sum(math.log((i + 2) / (i + 1)) * math.log(sp[i] / sp[i + 1]) for i in range(m - 1))
        den = sum(math.log((i + 2) / (i + 1)) ** 2 for i in range(m - 1))
        s_hat = num / den
        eps_hat = s_hat - 1
        k = int(((eps_hat * 2**mu) / (1 - len(sp) ** (-eps_hat))) ** (1 / s_hat))
        k = min(max(k, 1), len(sp))
        keep = [False] * len(probs)
        for token in order[:k]:
            keep[token] = True
    keep[order[0]] = True
    return renormalised(probs, keep)


# --- each sampler alone, mixed with rows that do not use it -----------------------------------

CASES = [
    ("top_a", dict(top_a=0.2), lambda r: ref_top_a(r, 0.2)),
    ("top_a_strong", dict(top_a=0.9), lambda r: ref_top_a(r, 0.9)),
    ("tfs", dict(tfs=0.95), lambda r: ref_tfs(r, 0.95)),
    ("tfs_low", dict(tfs=0.5), lambda r: ref_tfs(r, 0.5)),
    ("typical_p", dict(typical_p=0.6), lambda r: ref_typical(r, 0.6)),
    ("typical_p_high", dict(typical_p=0.95), lambda r: ref_typical(r, 0.95)),
    ("eta_cutoff", dict(eta_cutoff=8.0), lambda r: ref_eta(r, 8.0)),
    ("eta_cutoff_high", dict(eta_cutoff=300.0), lambda r: ref_eta(r, 300.0)),
    ("epsilon_cutoff", dict(epsilon_cutoff=30.0), lambda r: ref_epsilon(r, 30.0)),
    ("nsigma", dict(nsigma=1.5), lambda r: ref_nsigma(r, 1.5)),
    ("smoothing", dict(smoothing_factor=0.3), lambda r: ref_quadratic(r, 0.3, 1.0)),
    ("smoothing_curve", dict(smoothing_factor=0.2, smoothing_curve=2.5), lambda r: ref_quadratic(r, 0.2, 2.5)),
    ("dynatemp", dict(dynatemp_min=0.5, dynatemp_max=2.0), lambda r: ref_dynatemp(r, 0.5, 2.0, 1.0)),
    ("dynatemp_exp", dict(dynatemp_min=0.2, dynatemp_max=1.5, dynatemp_exponent=2.0), lambda r: ref_dynatemp(r, 0.2, 1.5, 2.0)),
    ("xtc", dict(xtc_probability=1.0, xtc_threshold=0.05), lambda r: ref_xtc(r, 0.05)),
    ("skew_pos", dict(skew=0.7), lambda r: ref_skew(r, 0.7)),
    ("skew_neg", dict(skew=-0.5), lambda r: ref_skew(r, -0.5)),
    ("mirostat_v2", dict(mirostat_mode=2, mirostat_tau=3.0), lambda r: ref_mirostat(r, 2, 6.0)),
    ("mirostat_v1", dict(mirostat_mode=1, mirostat_tau=3.0), lambda r: ref_mirostat(r, 1, 6.0)),
]


@pytest.mark.parametrize("name,options,reference", CASES, ids=[c[0] for c in CASES])
def test_sampler_matches_reference(name: str, options: dict, reference) -> None:
    seed = zlib.crc32(name.encode())
    logits = random_logits(8, seed=seed % 1000, scale=2.0 + seed % 3)
    on = SamplingParams(**options)
    plain = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0.0, **options)
    params = [on, plain, on, greedy, on, on, plain, on]
    probs = sampler_probs(logits, [make_state(p) for p in params])
    for row, p in enumerate(params):
        values = logits[row].double().tolist()
        expected = reference(values) if p is on else torch.tensor(softmax(values), dtype=torch.float64)
        # float32 underflows what float64 keeps at ~1e-38: compare kept sets above that
        underflow = (expected > 0) & (expected < 1e-30)
        assert not ((probs[row] > 0) != (expected > 0))[~underflow].any(), f"{name}: kept set differs on row {row}"
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)
    kept = [(probs[row] > 0).sum().item() for row, p in enumerate(params) if p is on]
    if name not in ("smoothing", "smoothing_curve", "dynatemp", "dynatemp_exp", "skew_pos", "skew_neg"):
        assert min(kept) < VOCAB, f"{name} should truncate these rows"


def test_greedy_row_ignores_distribution_samplers() -> None:
    logits = random_logits(2, seed=5)
    params = SamplingParams(temperature=0.0, xtc_probability=1.0, xtc_threshold=0.01, mirostat_mode=2, top_a=0.5)
    meta = SamplingMetadata.build([make_state(params), make_state(params)], VOCAB, CPU)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_temperature_applies_before_truncation_unless_last() -> None:
    # top-a on a sharpened row keeps fewer tokens than top-a first and temperature after
    logits = random_logits(1, seed=11, scale=1.0)
    first = SamplingParams(temperature=0.3, top_a=0.5)
    last = first.clone(temperature_last=True)
    probs_first = sampler_probs(logits, [make_state(first)])[0]
    probs_last = sampler_probs(logits, [make_state(last)])[0]
    row = logits[0].double().tolist()
    expected_first = ref_top_a([x / 0.3 for x in row], 0.5)
    kept = ref_top_a(row, 0.5) > 0
    expected_last = renormalised(softmax([x / 0.3 for x in row]), kept.tolist())
    torch.testing.assert_close(probs_first.double(), expected_first, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(probs_last.double(), expected_last, atol=1e-6, rtol=1e-4)
    assert (probs_first > 0).sum() < (probs_last > 0).sum()


def test_sampler_priority_reorders_stages_per_row() -> None:
    # min-p then top-k=3 vs top-k=3 then min-p: different kept sets on a flat-ish row
    logits = random_logits(4, seed=12, scale=0.5)
    default = SamplingParams(top_k=40, min_p=0.5, temperature=0.5)
    reordered = default.clone(sampler_priority=["min_p", "temperature", "top_k"])
    params = [default, reordered, default, reordered]
    probs = sampler_probs(logits, [make_state(p) for p in params])
    for row, p in enumerate(params):
        values = logits[row].double().tolist()
        if p is default:
            scaled = [x / 0.5 for x in values]
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[torch.tensor(scaled).topk(40).indices] = True
            sp = renormalised(softmax(scaled), keep.tolist())
            expected = renormalised(sp.tolist(), (sp >= 0.5 * sp.max()).tolist())
        else:
            raw = torch.tensor(softmax(values))
            keep = raw >= 0.5 * raw.max()
            expected = renormalised(softmax([x / 0.5 for x in values]), keep.tolist())
        assert torch.equal(probs[row] > 0, expected > 0), f"row {row}"
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)


def test_sampler_priority_accepts_aphrodite_ids_and_rejects_unknown() -> None:
    assert SamplingParams(sampler_priority=[5, "xtc", "TOP_K"]).sampler_priority == [5, 13, 0]
    with pytest.raises(ValueError, match="sampler_priority"):
        SamplingParams(sampler_priority=[99])
    with pytest.raises(ValueError, match="twice"):
        SamplingParams(sampler_priority=["top_k", "top_p"])
