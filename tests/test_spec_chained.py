"""Drafts chained behind verification (DFlash and DSpark): the drafter runs from the verify
step's device results, before the host reads them, and the result is the same as drafting
once the tokens are back. Each test runs the same requests with chaining and without it and
compares every step's drafts and every output token.

A random drafter's drafts are almost never kept, so one test also fixes how many drafts each
verify step keeps (a function of the drafts themselves, the same in both runs): the drafter's
context then has to drop exactly the rows after each rejected draft."""

from __future__ import annotations

import pytest
import torch

from sonar import LLM, SamplingParams
from sonar.tensors import to_device
from test_spec_dflash import PROMPTS, generate, random_drafter, targets  # noqa: F401 (a fixture)

K = 3


def mixed_params(max_tokens: int = 14) -> list[SamplingParams]:
    """Greedy requests, a penalised one (never drafts), a seeded sampled one and one short of
    ``min_tokens`` for its first steps."""
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.3)
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=max_tokens - 2, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=4, ignore_eos=True)
    return params


def run(target, folder, method: str, verification: str, chain: bool, params, fixed_acceptance: bool = False):
    """Outputs, every step's drafts (request -> drafts, in step order) and how many steps chained."""
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": K, "verification": verification}
    llm = LLM(str(target[0]), kv_cache_memory_bytes=2**23, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec)
    decoder = llm.llm_engine.core.executor.worker.model_runner.spec
    if not chain:  # chained runs keep the class default, so their chained steps show it is on
        decoder.chain_drafts = False
    steps, chained_steps = [], [0]
    after_step = decoder.after_step

    def recorded(output, req_ids, states, hidden, drafting, draft_limit, chained=None):
        after_step(output, req_ids, states, hidden, drafting, draft_limit, chained)
        chained_steps[0] += chained is not None
        if output.draft_token_ids:
            steps.append(dict(output.draft_token_ids))

    decoder.after_step = recorded
    if fixed_acceptance:
        decoder.verify = keep_by_drafts(decoder.verify)
    outputs = generate(llm, PROMPTS, params)
    return outputs, steps, chained_steps[0]


def keep_by_drafts(verify):
    """A verification that keeps ``sum(drafts) % (k + 1)`` drafts of each request (the
    target's argmax after them): lossy, but the same in both runs, so the drafter's context
    sees every count of kept drafts."""

    def fixed(sampler, logits, states, drafts, req_ids=None):
        verified = verify(sampler, logits, states, drafts, req_ids)
        layout, result = verified.layout, verified.result
        kept = [sum(d) % (len(d) + 1) if d else 0 for d in drafts]
        num_accepted = to_device(torch.tensor(kept, dtype=torch.int64), logits.device)
        keep = layout.offset < num_accepted[layout.row_of]
        result.token_ids = torch.where(keep, layout.draft_ids, result.token_ids)
        result.num_accepted = num_accepted
        return verified

    return fixed


@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_chained_drafts_equal_drafts_after_the_tokens(targets, tmp_path, method, layout):  # noqa: F811 (the fixture)
    target = targets("llama")
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    plain = run(target, folder, method, "fixed", False, mixed_params())
    chained = run(target, folder, method, "fixed", True, mixed_params())
    assert chained[0] == plain[0]
    assert chained[1] == plain[1] and plain[1]
    assert chained[2] > 0 and plain[2] == 0


@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_chained_context_keeps_only_the_kept_drafts(targets, tmp_path, method, layout):  # noqa: F811 (the fixture)
    target = targets("qwen3")
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    params = mixed_params(max_tokens=24)
    plain = run(target, folder, method, "fixed", False, params, fixed_acceptance=True)
    chained = run(target, folder, method, "fixed", True, params, fixed_acceptance=True)
    assert chained[0] == plain[0]
    assert chained[1] == plain[1]
    assert chained[2] > 0
    kept = [sum(d) % (K + 1) for step in plain[1] for d in step.values() if len(d) == K]
    assert set(kept) == set(range(K + 1))  # every count of kept drafts came up

