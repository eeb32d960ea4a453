"""Several verify passes a step with a drafter that drafts in passes (DFlash, DSpark;
``speculative_config["verify_passes"]``): greedy output token for token as without
speculation, fewer engine steps, every computed position in the drafter's cache once and in
order after the passes, ``max_tokens`` inside a pass; and the drafter's device-only drafting
between passes (``propose_pass``) drafts and keeps context as its chained drafting does."""

from __future__ import annotations

import pytest
import torch

from sonar import LLM, SamplingParams
from sonar.spec_decode.interface import ChainedStep, ProposerInputs

import test_spec_dflash
from test_spec_dflash import PROMPTS, assert_same_greedy, plain_runs, random_drafter

targets = test_spec_dflash.targets  # the tiny targets, as a fixture of this module too

K = 3


def steps(llm: LLM) -> int:
    return llm.llm_engine.core.num_steps_launched


def drafter_positions(runner, req_id: str) -> list[int]:
    cache = runner.spec.proposer.cache
    slots = cache._host_slots(req_id, 0, cache.committed[req_id])
    return cache.positions[torch.as_tensor(slots)].tolist()


@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_a_lone_request_runs_several_passes_a_step_with_greedy_output_unchanged(targets, tmp_path, method, layout):
    target = targets("llama")
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": K, "verification": "fixed"}
    common = dict(kv_cache_memory_bytes=2**22, max_model_len=128, skip_tokenizer_init=True)
    one, passes = LLM(str(target[0]), **common, speculative_config=spec), LLM(str(target[0]), **common, speculative_config={**spec, "verify_passes": 3})
    for prompt, max_tokens in zip(PROMPTS, (14, 9, 20, 5, 11)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (expected,) = plain_runs(target, [prompt], [params])
        counts, outputs = [], []
        for llm in (one, passes):
            before = steps(llm)
            outputs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
            counts.append(steps(llm) - before)
        for got in outputs:
            assert_same_greedy(got, expected)
        assert len(outputs[1]) == max_tokens
        if max_tokens > 5:
            assert counts[1] < counts[0], counts
    stats = passes.llm_engine.get_stats()
    assert stats.spec_num_drafts > 0
    runner = passes.llm_engine.core.executor.worker.model_runner
    passes.llm_engine.core.step()  # the worker hears of the last finished request with the next step
    assert runner.spec.proposer.cache.num_requests == 0


def test_the_drafter_holds_every_position_once_after_steps_of_passes(targets, tmp_path):
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    target = targets("qwen3")
    folder = random_drafter(target, tmp_path / "drafter", "deepspec", dspark=True)
    spec = {"method": "dspark", "model": str(folder), "num_speculative_tokens": K, "verify_passes": 4, "verification": "fixed"}
    engine = LLMEngine(EngineArgs(model=str(target[0]), kv_cache_memory_bytes=2**22, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec))
    engine.add_request("a", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    runner = engine.core.executor.worker.model_runner
    emitted = []
    for _ in range(12):
        (output,) = engine.step()
        emitted.append(len(output.outputs[0].token_ids))
        computed = runner.requests["a"].num_tokens - 1  # every position but the last sampled token's
        assert drafter_positions(runner, "a") == list(range(computed))
    assert engine.get_stats().spec_num_drafts > 0
    assert all(b - a >= 4 for a, b in zip(emitted[1:], emitted[2:])), emitted  # four passes a step, a token at least each


def test_drafting_between_passes_on_the_device_equals_chained_drafting(targets, tmp_path):
    """``propose_pass`` for a second pass (no host length in it) against ``propose_chained``
    with the same states after the first pass was settled on the host: the same drafts, the
    same survival estimates, the same device length and the same context in the cache."""
    target = targets("llama")
    folder = random_drafter(target, tmp_path / "drafter", "deepspec", dspark=True)
    spec = {"method": "dspark", "model": str(folder), "num_speculative_tokens": K, "verification": "fixed"}
    llm = LLM(str(target[0]), kv_cache_memory_bytes=2**22, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec)
    proposer = llm.llm_engine.core.executor.worker.model_runner.spec.proposer
    width = proposer.drafter.fc.in_features
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(10, width, generator=generator)
    passes = [(torch.randn(K + 1, width, generator=generator), torch.randint(200, 300, (K + 1,), generator=generator)) for _ in range(2)]
    kept = [1, 2]  # drafts kept by the first and second pass

    def first_pass(req_id: str) -> None:
        proposer.keep_context(ProposerInputs([req_id], [[0] * 11], [10], context, torch.arange(10), [10]))
        states, tokens = passes[0]
        step = ChainedStep([req_id], [K + 1], [0], [10], tokens, torch.tensor([kept[0]]), states, torch.arange(10, 10 + K + 1))
        proposer.propose_chained(step)

    second_position = 10 + kept[0] + 1
    states, tokens = passes[1]
    positions = torch.arange(second_position, second_position + K + 1)
    first_pass("chained")
    proposer.settle_chained(["chained"], [kept[0]])
    step = ChainedStep(["chained"], [K + 1], [0], [second_position], tokens, torch.tensor([kept[1]]), states, positions)
    expected = proposer.propose_chained(step)
    proposer.settle_chained(["chained"], [kept[1]])

    first_pass("device")
    assert proposer.begin_passes("device", 2 * (K + 1))
    anchor, anchor_position = tokens[kept[1]], torch.tensor(second_position + kept[1] + 1)
    drafts, survival = proposer.propose_pass("device", states, positions, torch.tensor(kept[1] + 1), anchor, anchor_position)
    proposer.settle_chained(["device"], [kept[0] + 1 + kept[1]])

    cache = proposer.cache
    assert drafts.tolist() == expected.token_ids[0].tolist()
    assert torch.allclose(survival, expected.confidence[0])
    rows = [cache.row_of(r) for r in ("chained", "device")]
    assert cache.device_lengths[rows[0]] == cache.device_lengths[rows[1]] == cache.lengths["device"] == cache.lengths["chained"] == 10 + kept[0] + 1 + kept[1] + 1
    slots = [torch.as_tensor(cache._host_slots(r, 0, cache.lengths[r])) for r in ("chained", "device")]
    assert cache.positions[slots[0]].tolist() == cache.positions[slots[1]].tolist() == list(range(cache.lengths["device"]))
    assert torch.equal(cache.kv[:, :, slots[0] // cache.block_size, slots[0] % cache.block_size], cache.kv[:, :, slots[1] // cache.block_size, slots[1] % cache.block_size])
    # a pass that did not run keeps nothing and drafts again after the same token
    again, _ = proposer.propose_pass("device", states, positions, torch.tensor(0), anchor, anchor_position)
    assert cache.device_lengths[rows[1]] == cache.lengths["device"]
    assert again.tolist() == drafts.tolist()

