"""Speculative decoding end to end (n-gram proposer, tiny random model): greedy output token
for token as without it, in mixed batches, under preemption, with the prefix cache, stop
tokens, stop strings, max_tokens and logprobs; seeded sampling reproducible; the flag and the
metrics."""

from __future__ import annotations

import pytest

from sonar import LLM, SamplingParams
from sonar.engine.wire import SchedulerStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
KV_BYTES = 2**23


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves: the model's continuation tends to copy it."""
    return [[(i * 13 + j * 7) % 97 + 200 for j in range(24)] * 2 for i in range(count)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def speculative(model):
    return LLM(model, kv_cache_memory_bytes=KV_BYTES, speculative_config=NGRAM)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def accepted_tokens(llm: LLM) -> int:
    return llm.llm_engine.get_stats().spec_num_accepted_tokens


def test_greedy_output_is_unchanged_in_a_batch_mixed_with_requests_that_cannot_speculate(plain, speculative):
    prompts = repetitive_prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=29, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)  # decodes without drafts
    params[3] = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, min_tokens=10)
    before = accepted_tokens(speculative)
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    got = [o.outputs[0].token_ids for o in generate(speculative, prompts, params)]
    assert got == expected
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    stats = speculative.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > before
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens
    assert stats.spec_accepted_per_position[0] >= stats.spec_accepted_per_position[-1]


def test_asynchronous_scheduling_overlaps_large_steps_and_speculates_in_small_ones(model, plain):
    """With asynchronous scheduling on, steps of more requests than disable_by_batch_size
    overlap (no drafts) and smaller ones verify drafts; greedy output is unchanged."""
    config = {**NGRAM, "disable_by_batch_size": 2}
    llm = LLM(model, kv_cache_memory_bytes=KV_BYTES, speculative_config=config, async_scheduling=True)
    assert llm.llm_engine.core.async_scheduling
    prompts = repetitive_prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 12, 40, 44)]
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
    assert got == expected
    assert accepted_tokens(llm) > 0  # the two long requests speculated once the batch shrank


def test_prefix_cache_hits_give_the_same_tokens(plain, speculative):
    prompts = repetitive_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    first = [o.outputs[0].token_ids for o in generate(speculative, prompts, params)]
    # the second run reuses the first one's blocks: only accepted tokens were ever hashed into them
    continued = [p + t[:30] for p, t in zip(prompts, first)]
    hits_before = speculative.llm_engine.get_stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in generate(speculative, continued, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    assert first == expected
    assert speculative.llm_engine.get_stats().prefix_cache_hits > hits_before
    assert again == [t[30:40] for t in expected]


def test_stop_tokens_stop_strings_and_max_tokens_cut_inside_an_accepted_run(plain, speculative):
    prompts = repetitive_prompts(4)
    reference = generate(plain, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in reference]
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tokens[0][17]]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[reference[1].outputs[0].text[-12:-6]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
    ]
    expected = generate(plain, prompts, params)
    got = generate(speculative, prompts, params)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert len(got[0].outputs[0].token_ids) <= 18 and got[1].outputs[0].finish_reason == "stop"
    want_lp, have_lp = expected[3].outputs[0].logprobs, got[3].outputs[0].logprobs
    assert len(have_lp) == 7
    for want_pos, have_pos in zip(want_lp, have_lp):
        assert want_pos.keys() == have_pos.keys()
        for token_id in want_pos:
            assert have_pos[token_id].logprob == pytest.approx(want_pos[token_id].logprob, abs=1e-4)


def test_preemption_under_a_tiny_kv_cache_keeps_greedy_output(model, plain):
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k/v, layers, block, kv heads, head_dim, fp32
    llm = LLM(model, max_model_len=128, kv_cache_memory_bytes=8 * block_bytes, speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
    stats = llm.llm_engine.get_stats()
    assert got == expected
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_seeded_sampling_with_speculation_is_reproducible(speculative):
    prompts = repetitive_prompts(2)
    params = SamplingParams(temperature=0.7, top_k=20, seed=1234, max_tokens=16, ignore_eos=True, n=2)
    first = [[c.token_ids for c in o.outputs] for o in generate(speculative, prompts, params)]
    second = [[c.token_ids for c in o.outputs] for o in generate(speculative, prompts, params)]
    assert first == second
    assert all(len(c) == 16 for o in first for c in o)


def test_unknown_method_lists_the_registered_ones(model):
    with pytest.raises(ValueError, match="registered: .*ngram"):
        LLM(model, speculative_config={"method": "medusa-x"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(model, speculative_config={"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})


def test_the_cli_flag_parses_json_into_engine_args():
    import argparse

    from sonar.cli.engine_args import add_engine_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_args_from(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 5}
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--speculative-config", "[1, 2]"])


def test_metrics_carry_vllms_speculative_names():
    from sonar_server.metrics import ServerMetrics

    stats = SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=7, spec_accepted_per_position=[4, 2, 1])
    text = ServerMetrics(lambda: stats, lambda: 0, "m").render().decode()
    assert 'sonar:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'sonar:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'sonar:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'sonar:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text


def test_an_engine_core_process_speculates_and_reports_its_acceptance(model, plain):
    """The multi-process path (as ``sonar serve`` runs it): the config crosses as JSON, the
    outputs carry several tokens per step, the stats carry the counters."""
    import tempfile
    from pathlib import Path

    import zmq

    from sonar.config import EngineArgs
    from sonar.engine import wire
    from sonar.engine.core_client import EngineProcesses
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform

    prompt = repetitive_prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = generate(plain, [prompt], params)[0].outputs[0].token_ids
    platform = current_platform()
    config, _ = resolve_engine_config(EngineArgs(model, kv_cache_memory_bytes=KV_BYTES, max_model_len=256, speculative_config=NGRAM), platform)
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
        router.send_multipart([identity, *wire.encode_request(wire.EngineCoreRequest("r", prompt, params, 24, 0.0))])
        tokens: list[int] = []
        most_per_step = 0
        stats = None
        while len(tokens) < 24:
            assert pull.poll(60_000)
            frames = pull.recv_multipart()
            if frames[0] != wire.OUTPUTS:
                continue
            decoded = wire.decode_outputs(frames)
            stats = decoded.stats
            for output in decoded.outputs:
                tokens += output.new_token_ids
                most_per_step = max(most_per_step, len(output.new_token_ids))
        assert tokens == expected
        assert most_per_step > 1 and stats.spec_num_accepted_tokens > 0
    finally:
        engines.terminate()
        context.destroy(linger=0)
