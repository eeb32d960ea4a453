"""Greedy outputs and logprobs equal transformers' on tiny random models of each architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import ARCHS, HFOracle, random_prompts
from sonar import LLM, SamplingParams
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request

NUM_PROMPTS = 16
NUM_TOKENS = 32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [None, 48])  # 48: prefill chunks mixed with decodes
def test_greedy_and_logprobs_match_transformers(tiny_model_dir, arch: str, budget: int | None) -> None:
    path = tiny_model_dir(arch)
    prompts = random_prompts(NUM_PROMPTS, seed=ARCHS.index(arch))
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=budget, max_model_len=512, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        expected, rows = oracle.greedy(prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert completion.finish_reason == "length"
        for step, (entry, row) in enumerate(zip(completion.logprobs, rows)):
            top = row.topk(5)
            assert set(top.indices.tolist()) <= set(entry), f"step {step}: top-5 ids differ"
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) < 1e-3
            chosen = expected[step]
            assert entry[chosen].rank == 1
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block returned


def test_prompt_logprobs_match_transformers(tiny_model_dir) -> None:
    import torch

    path = tiny_model_dir("qwen3")
    prompt = random_prompts(1, seed=7, min_len=40, max_len=40)[0]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    oracle = HFOracle(path)
    with torch.inference_mode():
        logits = oracle.model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        target = prompt[position]
        assert abs(entry[target].logprob - float(expected[position - 1, target])) < 1e-3
        assert len(entry) >= 3


def test_mistral_sliding_window_matches_transformers(tmp_path) -> None:
    from sonar_models.testing import build_tiny_model

    path = build_tiny_model("mistral", tmp_path / "mistral-window", sliding_window=12)
    prompts = random_prompts(4, seed=31, min_len=20, max_len=60)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == oracle.greedy(prompt, 16)[0]


def _greedy_step_by_step(
    path: Path,
    prompts: list[list[int]],
    num_tokens: int,
    on_step: Callable[[KVCacheManager, list[Request]], None],
    kv_cache_memory_bytes: int = 2 << 20,
) -> list[list[int]]:
    """Greedy outputs from an in-process engine (block size 4), calling ``on_step(kv_cache,
    running_requests)`` after every step."""
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32, max_model_len=128,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
    )
    engine = LLMEngine(args)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    core = engine.core
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        on_step(core.kv_cache, core.scheduler.running)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block returned
    return [done[str(i)] for i in range(len(prompts))]


def test_mistral_window_shorter_than_the_prompt_frees_blocks_and_matches_transformers(tmp_path) -> None:
    """Window 16, blocks of 4, prompts of 70-100 tokens, 40 blocks for 4 requests: while
    decoding, a request holds only the blocks of its last 16 positions (and the next one's);
    the blocks it gave back serve other requests while its block table still names them."""
    from sonar.engine.kv_cache_spec import SlidingWindowSpec
    from sonar_models.testing import build_tiny_model

    window, block = 16, 4
    path = build_tiny_model("mistral", tmp_path / "mistral-window16", sliding_window=window)
    prompts = random_prompts(4, seed=41, min_len=70, max_len=100)
    decode_checks = []
    stale_ids_reused = []

    def on_step(kv_cache: KVCacheManager, running: list[Request]) -> None:
        assert set(kv_cache.layer_specs) == {SlidingWindowSpec(window)}
        live = {rid: kv_cache.block_ids(rid, kv_cache.num_slid_out.get(rid, 0)) for rid in kv_cache.req_blocks}
        for rid in kv_cache.req_blocks:
            stale = set(kv_cache.block_ids(rid)[: kv_cache.num_slid_out.get(rid, 0)])
            stale_ids_reused.extend(b for other, ids in live.items() if other != rid for b in ids if b in stale)
        for request in running:
            computed = request.num_computed_tokens
            # decoding (never recomputed after a preemption): the last step computed position computed - 1
            if computed > request.num_prompt_tokens and not request.num_preemptions:
                held = kv_cache.num_held_blocks(request.request_id)
                assert held == -(-computed // block) - (computed - window) // block
                decode_checks.append(held < kv_cache.num_blocks_for(computed))

    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 slots, 2 KV heads of 16, float32
    outputs = _greedy_step_by_step(path, prompts, 24, on_step, kv_cache_memory_bytes=40 * block_bytes)
    assert decode_checks and all(decode_checks)  # blocks were given back on every decode step
    assert stale_ids_reused  # a stale block-table entry named another request's block
    oracle = HFOracle(path)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == oracle.greedy(prompt, 24)[0]


def test_qwen2_sliding_layers_from_max_window_layers_match_transformers(tmp_path) -> None:
    """``use_sliding_window`` with ``max_window_layers=1``: transformers slides layers 1 and up
    (its ``layer_types``), layer 0 attends fully; the full layer keeps every block."""
    from sonar.engine.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
    from sonar_models.testing import build_tiny_model

    window = 8
    path = build_tiny_model("qwen2", tmp_path / "qwen2-window8", use_sliding_window=True, sliding_window=window, max_window_layers=1)
    full_path = build_tiny_model("qwen2", tmp_path / "qwen2-full", use_sliding_window=False)
    prompts = random_prompts(3, seed=43, min_len=30, max_len=60)

    def on_step(kv_cache: KVCacheManager, running: list[Request]) -> None:
        assert set(kv_cache.layer_specs) == {FullAttentionSpec(), SlidingWindowSpec(window)}
        for request in running:
            assert kv_cache.num_held_blocks(request.request_id) == kv_cache.num_blocks_for(request.num_computed_tokens)

    outputs = _greedy_step_by_step(path, prompts, 16, on_step)
    oracle, full_oracle = HFOracle(path), HFOracle(full_path)
    assert oracle.model.config.layer_types == ["full_attention", "sliding_attention"]
    expected = [oracle.greedy(prompt, 16)[0] for prompt in prompts]
    assert outputs == expected
    # the window changes transformers' answer: the test sees it applied, not ignored
    assert expected != [full_oracle.greedy(prompt, 16)[0] for prompt in prompts]
