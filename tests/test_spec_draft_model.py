"""Speculative decoding with a draft model (tiny random models): greedy output token for token
as without it, in mixed batches, under preemption, with the prefix cache, stop strings,
max_tokens and logprobs; the target as its own drafter accepts every draft, greedy and sampled
(which only happens when the drafter's probabilities reach the verifier); seeded sampling is
reproducible; bad draft models are refused clearly; the engine-core process runs it."""

from __future__ import annotations

import pytest
from sonar import LLM, SamplingParams

KV_BYTES = 2**23
K = 3


def prompts_of(count: int, length: int = 20) -> list[list[int]]:
    return [[(i * 31 + j * 7) % 500 + 100 for j in range(length)] for i in range(count)]


def spec_config(drafter: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": drafter, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def small_drafter(tmp_path_factory) -> str:
    """A different, smaller random model of the same vocabulary: it rarely agrees."""
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("drafter") / "llama-small"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    return str(build_tiny_model("llama", folder, **shape))  # head_dim 16: the smallest the GPU kernels take


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def self_drafted(target):
    """The target drafting for itself: every draft agrees with the target."""
    return LLM(target, kv_cache_memory_bytes=KV_BYTES, speculative_config=spec_config(target))


@pytest.fixture(scope="module")
def small_drafted(target, small_drafter):
    return LLM(target, kv_cache_memory_bytes=KV_BYTES, speculative_config=spec_config(small_drafter))


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def token_ids(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in generate(llm, prompts, params)]


def counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def since(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(now - then for now, then in zip(counters(llm), before))


def middle_of(text: str) -> str:
    return text[len(text) // 2 : len(text) // 2 + 5]


def mixed_params() -> list[SamplingParams]:
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in range(4)]
    params[1] = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, repetition_penalty=1.3)  # no drafts
    params[3] = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True, min_tokens=8)  # drafts after 8 tokens
    return params


def test_the_target_as_its_own_drafter_gives_the_same_tokens_and_accepts_every_draft(plain, self_drafted):
    prompts, params = prompts_of(4), mixed_params()
    expected = token_ids(plain, prompts, params)
    before = counters(self_drafted)
    got = token_ids(self_drafted, prompts, params)
    num_drafts, num_draft_tokens, num_accepted = since(self_drafted, before)
    assert got == expected
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    # the catch-up and rollback bookkeeping is right: the drafter saw exactly the target's tokens
    assert num_drafts > 10 and num_accepted >= 0.95 * num_draft_tokens
    # request 1 (penalties) never drafts: fewer drafts than all four requests' steps would give
    assert num_draft_tokens < sum(p.max_tokens for p in params)


def test_the_drafter_rolls_back_rejected_drafts_and_catches_up_as_a_fresh_one_would(plain, self_drafted):
    from sonar.spec_decode import ProposerInputs

    proposer = self_drafted.llm_engine.core.executor.worker.model_runner.spec.proposer
    prompt = prompts_of(1, 23)[0]
    greedy = token_ids(plain, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]

    def propose(req_id: str, sequence: list[int], num_accepted: int = 1) -> list[int]:
        return proposer.propose(ProposerInputs([req_id], [sequence], [num_accepted])).token_ids[0]

    # the target drafting for itself: its drafts are the target's own greedy continuation
    assert propose("roll", prompt + greedy[:1]) == greedy[1 : 1 + K]
    assert proposer.sequences["roll"].token_ids == prompt + greedy[: K]  # the last draft is never fed
    # the step kept one draft and replaced the second: the drafter rolls back to it
    wrong = (greedy[2] + 1) % 49152
    sequence = prompt + greedy[:2] + [wrong]
    again = propose("roll", sequence, num_accepted=2)
    assert proposer.sequences["roll"].token_ids[: len(sequence)] == sequence
    assert again == propose("fresh", sequence)
    assert propose("fresh", sequence) == again  # no new tokens: the same drafts again
    proposer.remove_requests({"roll", "fresh"})
    assert "roll" not in proposer.sequences and "fresh" not in proposer.kv.block_table.row_of


def test_a_different_drafter_is_rejected_yet_the_tokens_are_the_same(plain, small_drafted):
    prompts, params = prompts_of(4), mixed_params()
    expected = token_ids(plain, prompts, params)
    before = counters(small_drafted)
    got = token_ids(small_drafted, prompts, params)
    num_drafts, num_draft_tokens, num_accepted = since(small_drafted, before)
    assert got == expected
    assert num_drafts > 10 and num_accepted < 0.5 * num_draft_tokens  # mostly rejected: rollbacks ran


def test_preemption_under_a_tiny_kv_cache_keeps_greedy_output(target, small_drafter, plain):
    prompts = prompts_of(4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = token_ids(plain, prompts, params)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k/v, layers, block, kv heads, head_dim, fp32
    for drafter in (target, small_drafter):
        llm = LLM(target, max_model_len=96, kv_cache_memory_bytes=7 * block_bytes, speculative_config=spec_config(drafter))
        assert token_ids(llm, prompts, params) == expected
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
        if drafter == target:
            assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens


def test_prefix_cache_hits_stop_strings_max_tokens_and_logprobs(plain, self_drafted):
    prompts = prompts_of(4)
    reference = generate(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in reference]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[tokens[0][13]]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[middle_of(reference[1].outputs[0].text)]),
        SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),  # 11 = 1 + 3 * (1 + K) - 2: cut inside a run
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
    ]
    expected = generate(plain, prompts, params)
    hits_before = self_drafted.llm_engine.get_stats().prefix_cache_hits
    got = generate(self_drafted, prompts, params)  # the prompts were cached by an earlier run
    assert self_drafted.llm_engine.get_stats().prefix_cache_hits > hits_before or hits_before > 0
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert got[1].outputs[0].finish_reason == "stop"
    want_lp, have_lp = expected[3].outputs[0].logprobs, got[3].outputs[0].logprobs
    assert len(have_lp) == 9
    for want_pos, have_pos in zip(want_lp, have_lp):
        assert want_pos.keys() == have_pos.keys()
        for token_id in want_pos:
            assert have_pos[token_id].logprob == pytest.approx(want_pos[token_id].logprob, abs=1e-4)
    # continuing the outputs as new prompts hits the prefix cache and gives the same tokens
    continued = [p + t[:20] for p, t in zip(prompts, tokens)]
    hits_before = self_drafted.llm_engine.get_stats().prefix_cache_hits
    again = token_ids(self_drafted, continued, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert self_drafted.llm_engine.get_stats().prefix_cache_hits > hits_before
    assert again == [t[20:30] for t in tokens]


def test_sampled_drafts_from_the_target_itself_are_all_accepted_and_seeded_runs_repeat(self_drafted, small_drafted):
    """With the drafter's distribution equal to the target's, rejection sampling keeps every
    draft (p / q = 1); were the drafts treated as one-hot, it would keep each with p(d) only."""
    prompts = prompts_of(3)
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # a greedy row among sampled ones
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=8, max_tokens=12, ignore_eos=True),
    ]
    before = counters(self_drafted)
    first = token_ids(self_drafted, prompts, params)
    num_drafts, num_draft_tokens, num_accepted = since(self_drafted, before)
    assert num_drafts > 3 and num_accepted >= 0.9 * num_draft_tokens
    assert token_ids(self_drafted, prompts, params) == first
    assert all(len(t) == 12 for t in first)
    # a drafter that disagrees: seeded runs repeat too (its draws come from the request's generator)
    seeded = [SamplingParams(temperature=0.9, seed=s, max_tokens=8, ignore_eos=True, n=2) for s in (1, 2)]
    once = [[c.token_ids for c in o.outputs] for o in generate(small_drafted, prompts[:2], seeded)]
    twice = [[c.token_ids for c in o.outputs] for o in generate(small_drafted, prompts[:2], seeded)]
    assert once == twice


def test_bad_draft_models_are_refused_with_what_is_wrong(target, tmp_path):
    from sonar_models.testing import build_tiny_model

    with pytest.raises(ValueError, match='needs "model"'):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not exist"):
        LLM(target, speculative_config=spec_config(str(tmp_path / "missing")))
    other_vocab = str(build_tiny_model("llama", tmp_path / "vocab", vocab_size=1000, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target model 49152"):
        LLM(target, kv_cache_memory_bytes=KV_BYTES, speculative_config=spec_config(other_vocab))


def test_an_engine_core_process_drafts_with_a_draft_model(target, plain):
    """The multi-process path (as ``sonar serve --speculative-config`` runs it)."""
    import tempfile
    from pathlib import Path

    import zmq
    from sonar.config import EngineArgs
    from sonar.engine import wire
    from sonar.engine.core_client import EngineProcesses
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform

    prompt = prompts_of(1)[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = token_ids(plain, [prompt], params)[0]
    platform = current_platform()
    args = EngineArgs(target, kv_cache_memory_bytes=KV_BYTES, max_model_len=256, speculative_config=spec_config(target))
    config, _ = resolve_engine_config(args, platform)
    ipc = Path(tempfile.mkdtemp(prefix="sonar-test-ipc-"))
    addresses = wire.ClientAddresses(f"ipc://{ipc}/in", f"ipc://{ipc}/out")
    context = zmq.Context()
    router, pull = context.socket(zmq.ROUTER), context.socket(zmq.PULL)
    router.bind(addresses.input)
    pull.bind(addresses.output)
    engines = EngineProcesses(config, [addresses], platform.replica_env)
    try:
        assert router.poll(120_000), "the engine core said it is ready"
        identity, kind, _ = router.recv_multipart()
        assert kind == wire.READY
        router.send_multipart([identity, *wire.encode_request(wire.EngineCoreRequest("r", prompt, params, 16, 0.0))])
        tokens: list[int] = []
        stats = None
        while len(tokens) < 16:
            assert pull.poll(60_000)
            frames = pull.recv_multipart()
            if frames[0] != wire.OUTPUTS:
                continue
            decoded = wire.decode_outputs(frames)
            stats = decoded.stats
            for output in decoded.outputs:
                tokens += output.new_token_ids
        assert tokens == expected
        assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    finally:
        engines.terminate()
        context.destroy(linger=0)
