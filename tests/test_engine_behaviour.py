"""Prefix caching, preemption, seeds, abort and limits, seen through the public API."""

from __future__ import annotations

import pytest

from conftest import random_prompts
from sonar import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prefix_cache_hits_and_matches_uncached_run(llama_dir) -> None:
    shared = random_prompts(1, seed=11, min_len=200, max_len=200)[0]
    first = shared + [501, 502, 503]
    second = shared + [777, 778]
    cached = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    cached.generate({"prompt_token_ids": first}, GREEDY)
    before = cached.llm_engine.get_stats().prefix_cache_hits
    out_cached = cached.generate({"prompt_token_ids": second}, GREEDY)[0]
    hits = cached.llm_engine.get_stats().prefix_cache_hits - before
    assert hits >= 192  # 12 full blocks of 16 shared tokens
    assert out_cached.num_cached_tokens == hits

    uncached = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    out_plain = uncached.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert uncached.llm_engine.get_stats().prefix_cache_hits == 0
    assert out_cached.outputs[0].token_ids == out_plain.outputs[0].token_ids


def test_preemption_gives_the_same_outputs(llama_dir) -> None:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(12, seed=5, min_len=40, max_len=120)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    roomy = LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20)
    expected = _token_ids(roomy.generate(prompts, params))
    # 16 blocks of 16 tokens: room for one or two sequences at a time
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k/v, layers, block, kv heads, head_dim, fp32
    tight = LLM(str(llama_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 * block_bytes)
    assert tight.llm_engine.core.cache_config.num_blocks == 16
    got = _token_ids(tight.generate(prompts, params))
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert stats.num_free_blocks == stats.num_total_blocks


def test_seeded_sampling_is_independent_of_the_batch(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    prompt = {"prompt_token_ids": random_prompts(1, seed=3)[0]}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(15, seed=4)]
    mixed_params = [SamplingParams(temperature=1.0, top_k=20, max_tokens=40, ignore_eos=True) for _ in others]
    batch = llm.generate(others[:7] + [prompt] + others[7:], mixed_params[:7] + [seeded] + mixed_params[7:])
    assert batch[7].outputs[0].token_ids == alone
    different_seed = llm.generate(prompt, seeded.clone(seed=99))[0].outputs[0].token_ids
    assert different_seed != alone


def test_n_completions_and_stop_strings(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": random_prompts(1, seed=8)[0]}
    base = llm.generate(prompt, GREEDY)[0].outputs[0]
    stop = base.text[5:9]
    assert stop.strip()
    stopped = llm.generate(prompt, GREEDY.clone(stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == base.text[: base.text.index(stop)]
    several = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5))[0]
    assert [c.index for c in several.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 or c.finish_reason == "stop" for c in several.outputs)
    assert tokenizer is not None


def test_limits_give_clear_errors(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="max_tokens=200 exceeds the model's context of 128 tokens"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="prompt is 128 tokens"):
        llm.generate({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate({"prompt_token_ids": [10**9]})
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=4096)
    # the engine is still healthy and holds no blocks
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].finish_reason == "length"
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_abort_frees_blocks_at_once(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(4, seed=9, min_len=50, max_len=80)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_total_blocks
    aborted = engine.abort_request(["r0", "r1", "r2", "r3"])
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not engine.has_unfinished_requests()


def test_streamed_text_never_shows_part_of_a_stop_string(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    prompt = {"prompt_token_ids": random_prompts(1, seed=8)[0]}
    full = llm.generate(prompt, GREEDY)[0].outputs[0].text
    stop = full[10:16]
    engine = llm.llm_engine
    engine.add_request("s", prompt, GREEDY.clone(stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(o.outputs[0].text for o in engine.step())
    final = texts[-1]
    assert final == full[: full.index(stop)]
    assert all(final.startswith(t) for t in texts)


def test_bad_words_are_never_generated(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": random_prompts(1, seed=21)[0]}
    plain = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    banned_word = tokenizer.decode(plain[:1]).strip()
    assert banned_word
    banned = llm.generate(prompt, GREEDY.clone(bad_words=[banned_word]))[0].outputs[0].token_ids
    for variant in (banned_word, " " + banned_word):
        ids = tokenizer.encode(variant, add_special_tokens=False)
        assert not any(banned[i : i + len(ids)] == ids for i in range(len(banned)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt, GREEDY.clone(allowed_token_ids=[10**7]))


def test_a_row_with_every_token_removed_still_obeys_its_hard_constraints(llama_dir) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    prompt = {"prompt_token_ids": random_prompts(1, seed=22)[0]}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, allowed_token_ids=[5], no_repeat_ngram_size=1)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == [5] * 6


@pytest.mark.parametrize("where", ["launch", "fetch"])
def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on(llama_dir, where: str) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompts(1, seed=41, min_len=40, max_len=40)[0]}
    expected = LLM(str(llama_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False).generate(prompt, GREEDY)[0].outputs[0].token_ids
    executor = engine.core.executor
    real = getattr(executor, where)
    calls = {"n": 0}

    def flaky(argument):
        calls["n"] += 1
        if calls["n"] == 1:  # the prefill: its blocks were hashed when scheduled, never written
            raise RuntimeError("injected failure")
        return real(argument)

    setattr(executor, where, flaky)
    engine.add_request("victim", prompt, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["victim"].outputs[0].finish_reason == "abort"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    # the same prompt again: no prefix-cache hit on the never-written blocks, the right output
    after = llm.generate(prompt, GREEDY)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == expected


def test_unsupported_options_are_refused_clearly(llama_dir) -> None:
    with pytest.raises(ValueError, match="quantization='nf5' is not a registered quantization method; registered: .*fp8"):
        LLM(str(llama_dir), quantization="nf5")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(llama_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(str(llama_dir), max_model_len=10**6)
