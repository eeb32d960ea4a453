"""Several verify passes in one engine step (``speculative_config["verify_passes"]``, n-gram):
greedy output token for token as without speculation, cut at stop tokens, eos and
``max_tokens`` inside any pass, in batches (where the passes stay off), under preemption and
at the end of the context, on a tiny random model and on the real embedded one; fewer engine
steps for the same tokens; the option checked."""

from __future__ import annotations

import pytest

from sonar import LLM, SamplingParams, registry
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.spec_decode import DraftTokens, Proposer
from sonar.spec_decode.resolve import resolve_speculative_config

from test_spec_decode import KV_BYTES, repetitive_prompts

PASSES = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "verify_passes": 3}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def passes(model):
    return LLM(model, kv_cache_memory_bytes=KV_BYTES, speculative_config=PASSES)


def one_by_one(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    return [llm.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0].outputs[0] for p, q in zip(prompts, params)]


def steps(llm: LLM) -> int:
    return llm.llm_engine.core.num_steps_launched


def test_a_lone_request_takes_fewer_steps_for_the_same_tokens(model, plain, passes):
    one_pass = LLM(model, kv_cache_memory_bytes=KV_BYTES, speculative_config={**PASSES, "verify_passes": 1})
    prompts = repetitive_prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (61, 40, 9)]
    expected = [o.token_ids for o in one_by_one(plain, prompts, params)]
    before_one, before_passes = steps(one_pass), steps(passes)
    drafts_before = passes.llm_engine.get_stats().spec_num_drafts
    assert [o.token_ids for o in one_by_one(one_pass, prompts, params)] == expected
    assert [o.token_ids for o in one_by_one(passes, prompts, params)] == expected
    one_steps, pass_steps = steps(one_pass) - before_one, steps(passes) - before_passes
    stats = passes.llm_engine.get_stats()
    # a step whose first pass has drafts runs up to three (105 steps against 75 when written)
    assert pass_steps <= 0.8 * one_steps
    assert stats.spec_num_drafts > drafts_before
    assert stats.spec_num_proposed_tokens >= stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens


def test_stops_and_lengths_inside_any_pass_end_the_request_where_plain_decoding_does(plain, passes):
    prompts = repetitive_prompts(4)
    reference = one_by_one(plain, prompts, [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * 4)
    tokens = [o.token_ids for o in reference]
    cases = []
    for n in range(1, 16):  # max_tokens ending in every pass and every position of the first ones
        cases.append((0, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    for at in (3, 8, 13, 21, 30):  # a stop token first emitted at each of these positions
        token = tokens[1][at]
        if token not in tokens[1][:at]:
            cases.append((1, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[token])))
    cases.append((2, SamplingParams(temperature=0, max_tokens=48, stop=[reference[2].text[-15:-9]])))
    cases.append((3, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, min_tokens=11)))
    for index, params in cases:
        want = one_by_one(plain, [prompts[index]], [params])[0]
        have = one_by_one(passes, [prompts[index]], [params])[0]
        assert (have.token_ids, have.text, have.finish_reason) == (want.token_ids, want.text, want.finish_reason), params


def test_eos_inside_a_pass_stops_the_request(model, plain, passes):
    prompt = repetitive_prompts(1)[0]
    reference = one_by_one(plain, [prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])[0].token_ids
    eos = reference[17]
    plain_eos = LLM(model, kv_cache_memory_bytes=KV_BYTES)
    passes_eos = LLM(model, kv_cache_memory_bytes=KV_BYTES, speculative_config=PASSES)
    for llm in (plain_eos, passes_eos):  # the model's eos, as the engine core gives it to each request
        object.__setattr__(llm.llm_engine.core.model_config, "eos_token_ids", (eos,))
    params = SamplingParams(temperature=0, max_tokens=40)
    want = one_by_one(plain_eos, [prompt], [params])[0]
    have = one_by_one(passes_eos, [prompt], [params])[0]
    assert have.token_ids == want.token_ids and have.finish_reason == want.finish_reason == "stop"
    assert len(have.token_ids) <= 18


def test_batches_sampling_and_logprobs_keep_one_pass_and_their_output(plain, passes):
    prompts = repetitive_prompts(3)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=22, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, repetition_penalty=1.2),
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    expected = plain.generate(batch, params, use_tqdm=False)
    got = passes.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    alone = one_by_one(passes, prompts[1:2], params[1:2])[0]  # logprobs: one pass a step, the same numbers
    want = expected[1].outputs[0]
    assert alone.token_ids == want.token_ids
    for want_pos, have_pos in zip(want.logprobs, alone.logprobs):
        assert want_pos.keys() == have_pos.keys()
        for token_id in want_pos:
            assert have_pos[token_id].logprob == pytest.approx(want_pos[token_id].logprob, abs=1e-4)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in one_by_one(passes, prompts[:1], [seeded])] == [o.token_ids for o in one_by_one(passes, prompts[:1], [seeded])]


def test_preemption_and_a_short_context_keep_greedy_output(model, plain):
    prompts = repetitive_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k/v, layers, block, kv heads, head_dim, fp32
    tight = LLM(model, max_model_len=128, kv_cache_memory_bytes=8 * block_bytes, speculative_config=PASSES)
    got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == expected
    assert tight.llm_engine.get_stats().num_preemptions > 0
    # the context ends inside the reserved rows: the model's length bounds them
    short = LLM(model, max_model_len=64, kv_cache_memory_bytes=KV_BYTES, speculative_config=PASSES)
    long_ask = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = one_by_one(LLM(model, max_model_len=64, kv_cache_memory_bytes=KV_BYTES), prompts[:1], [long_ask])[0]
    have = one_by_one(short, prompts[:1], [long_ask])[0]
    assert have.token_ids == want.token_ids and len(have.token_ids) == 16


class _NoPasses(Proposer):
    def propose(self, inputs):
        return DraftTokens(inputs.req_ids, [[] for _ in inputs.req_ids])


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("test-no-passes", _NoPasses)


def test_prefix_cache_hits_after_passes_give_the_same_tokens(plain, passes):
    """Only kept tokens were ever hashed into the blocks a step of passes wrote: a second run
    that continues the first one's output hits them and decodes as plainly."""
    prompts = repetitive_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in one_by_one(plain, prompts, [params] * 2)]
    first = [o.token_ids for o in one_by_one(passes, prompts, [params] * 2)]
    continued = [p + t[:30] for p, t in zip(prompts, first)]
    hits_before = passes.llm_engine.get_stats().prefix_cache_hits
    again = [o.token_ids for o in one_by_one(passes, continued, [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 2)]
    assert first == expected
    assert passes.llm_engine.get_stats().prefix_cache_hits > hits_before
    assert again == [t[30:40] for t in expected]


def test_the_option_is_checked():
    assert resolve_speculative_config(PASSES).verify_passes == 3
    with pytest.raises(ValueError, match="verify_passes"):
        resolve_speculative_config({**PASSES, "verify_passes": 0})
    with pytest.raises(ValueError, match="verify_passes"):
        resolve_speculative_config({**PASSES, "verify_passes": "2"})
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="test-no-passes")
    registry.clear_caches()
    try:
        with pytest.raises(ValueError, match="verify_passes.*drafts between passes"):
            resolve_speculative_config({"method": "test-no-passes", "num_speculative_tokens": 2, "verify_passes": 2})
        assert resolve_speculative_config({"method": "test-no-passes", "num_speculative_tokens": 2}).verify_passes == 1
    finally:
        manager.unregister(name="test-no-passes")
        registry.clear_caches()


def test_the_embedded_model_copying_code_fills_every_pass_and_decodes_as_without_them():
    """The real SmolLM2 GGUF (natively quantized, as it is served; its decode and verify rows
    both take the int8 product, row by row) asked to repeat code: long accepted runs,
    so passes end where the step's rows run out; ``max_tokens`` cut as plainly early, inside a
    step's passes and at its end."""
    common = dict(max_model_len=1024)
    ngram = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    engines = LLM(**common), LLM(**common, speculative_config=ngram), LLM(**common, speculative_config={**ngram, "verify_passes": 3})
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
    messages = [{"role": "user", "content": "Repeat this code exactly, then stop:\n" + code}]
    for max_tokens in (23, 61, 64):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outputs, counts = [], []
        for llm in engines:
            before = steps(llm)
            outputs.append(llm.chat(messages, params, use_tqdm=False)[0].outputs[0])
            counts.append(steps(llm) - before)
        assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids
        assert outputs[0].finish_reason == outputs[2].finish_reason
        assert counts[2] < counts[1] < counts[0]  # fewer steps with n-gram drafts, fewer still with three passes a step
