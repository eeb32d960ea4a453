"""Confidence-scheduled verification end to end (tiny random Llama target, CPU): a proposer
plugin whose drafts carry survival estimates (n-gram drafts with a scripted confidence
profile) gives greedy output token for token as without speculation; the start-up profile
of the target's step time runs on the CPU worker; the scheduler verifies every draft where
the cost curve is flat, and cuts them (verified < proposed, drafting then skipped) where it
is steep; a DSpark drafter, confidence-scheduled by default, through an engine-core process."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from sonar import LLM, SamplingParams, registry
from sonar.engine.step_cost import StepCostModel, profile_token_counts
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.spec_decode import DraftTokens, ProposerInputs
from sonar.spec_decode.ngram import NgramProposer
from sonar.spec_decode.verification import ConfidenceVerification

VOCAB = 512
KV_BYTES = 2**23
K = 4
SURVIVAL = [0.9, 0.75, 0.55, 0.35]  # the scripted confidence of drafts 1..4


class ScriptedConfidence(NgramProposer):
    """N-gram drafts, each position's survival estimate taken from ``SURVIVAL``."""

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        drafts = super().propose(inputs)
        drafts.confidence = [SURVIVAL[: len(tokens)] if tokens else None for tokens in drafts.token_ids]
        return drafts


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("scripted-confidence", ScriptedConfidence)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama without a tokenizer (prompts are token ids)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("verification-target")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def scripted_plugin():
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="test-scripted-confidence")
    registry.clear_caches()
    try:
        yield
    finally:
        manager.unregister(name="test-scripted-confidence")
        registry.clear_caches()


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves: the continuation tends to copy it."""
    return [[(i * 13 + j * 7) % 97 + 200 for j in range(20)] * 2 for i in range(count)]


PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 20, 28, 16, 24, 22)]


def generate(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    plain = LLM(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=256, skip_tokenizer_init=True)
    return generate(plain, repetitive_prompts(len(PARAMS)), PARAMS)


@pytest.fixture(scope="module")
def confident(target, scripted_plugin):
    """An engine whose verification is scheduled by confidence, and its start-up time."""
    spec = {"method": "scripted-confidence", "num_speculative_tokens": K, "prompt_lookup_max": 3, "verification": "confidence"}
    started = time.perf_counter()
    # no prefix cache: the profile test below writes into the KV cache again after start-up
    llm = LLM(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=256, skip_tokenizer_init=True, speculative_config=spec,
              enable_prefix_caching=False)  # fmt: skip
    return llm, time.perf_counter() - started


def use_costs(llm: LLM, costs: StepCostModel) -> None:
    """Schedule the engine's verification against ``costs`` instead of its profiled curve."""
    scheduler = llm.llm_engine.core.scheduler
    scheduler.verification = ConfidenceVerification(costs, K, llm.llm_engine.config.max_num_batched_tokens, scheduler.spec_stats)


def counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.spec_num_proposed_tokens, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def test_the_step_cost_is_profiled_on_the_cpu_worker_at_start_up(confident):
    from sonar.worker.step_profile import profile_step_seconds

    llm, startup_s = confident
    costs = llm.llm_engine.core.step_costs
    assert isinstance(costs, StepCostModel) and llm.llm_engine.core.scheduler.verification is not None
    counts = list(costs.num_tokens)
    # the grid from 1, as far as the CPU's time budget (1 s) went on this host's load (two counts at least)
    assert len(counts) >= 2 and counts == profile_token_counts(llm.llm_engine.config.max_num_batched_tokens)[: len(counts)]
    assert costs.context_len > 0 and all(b >= a for a, b in zip(costs.seconds, costs.seconds[1:]))
    assert startup_s < 30
    # the same profile over chosen counts, with time to finish: more tokens in a step cost more
    worker = llm.llm_engine.core.executor.worker
    counts, seconds, _ = profile_step_seconds(worker.model_runner, worker.platform, [1, 8, 256], repeats=10, budget_s=60.0)  # best of 10: robust to a loaded host
    assert counts == [1, 8, 256]
    assert seconds[2] > seconds[0]
    model = StepCostModel.from_samples(counts, seconds)
    assert model.cost(128) == pytest.approx(model.seconds[1] + (model.seconds[2] - model.seconds[1]) * 120 / 248)
    # no time at all (a host loaded at start-up): still two counts, so the curve has a slope
    counts, _, _ = profile_step_seconds(worker.model_runner, worker.platform, [1, 8, 256], budget_s=0.0)
    assert counts == [1, 8]


def test_the_profile_times_the_counts_where_the_runner_cost_jumps(confident, monkeypatch):
    """A runner whose graphs end at 40 rows has the profile time 40 and 41 tokens besides its
    grid (which holds neither), so the curve does not average across the jump."""
    from sonar.worker import step_profile

    llm, _ = confident
    worker = llm.llm_engine.core.executor.worker
    monkeypatch.setitem(step_profile.PROFILE_BUDGET_S, "cpu", 60.0)
    monkeypatch.setattr(worker.model_runner, "step_cost_edges", lambda: [40, 41, 4096])
    costs = worker.profile_step_costs(64)
    assert 40 not in profile_token_counts(64) and 41 not in profile_token_counts(64)
    assert list(costs.num_tokens) == sorted(set(profile_token_counts(64)) | {40, 41})  # past max_tokens: left out


def test_a_step_budget_longer_than_the_sequences_hold_still_starts_and_profiles(target, scripted_plugin):
    """Few short sequences and a larger token budget per step (2 x 63 tokens against 256): the
    start-up profile times only the steps that fit the sequences, and the engine serves."""
    spec = {"method": "scripted-confidence", "num_speculative_tokens": K, "prompt_lookup_max": 3, "verification": "confidence"}
    llm = LLM(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=256,
              skip_tokenizer_init=True, speculative_config=spec, enable_prefix_caching=False)  # fmt: skip
    costs = llm.llm_engine.core.step_costs
    assert len(costs.num_tokens) >= 2 and max(costs.num_tokens) <= 2 * 63
    prompts = repetitive_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=64, max_num_seqs=2, skip_tokenizer_init=True)
    assert generate(llm, prompts, params) == generate(plain, prompts, params)


def test_greedy_output_is_unchanged_with_every_draft_verified_on_a_flat_curve(confident, expected):
    llm, _ = confident
    use_costs(llm, StepCostModel.from_samples([1, 4096], [0.010, 0.0101]))
    before = counters(llm)
    got = generate(llm, repetitive_prompts(len(PARAMS)), PARAMS)
    proposed, verified, accepted = (a - b for a, b in zip(counters(llm), before))
    assert got == expected
    assert verified > 0 and accepted > 0
    assert verified >= 0.8 * proposed  # the rest: drafts past a request's max_tokens, or of a request that finished


def test_a_steep_curve_cuts_the_drafts_and_stops_drafting(confident, expected):
    llm, _ = confident
    # compute-bound from the first token: a draft costs as much as a decode, so no estimate
    # below 1 is worth verifying, at any batch size
    use_costs(llm, StepCostModel.from_samples([1, 4096], [0.0001, 0.4096]))
    before = counters(llm)
    got = generate(llm, repetitive_prompts(len(PARAMS)), PARAMS)
    proposed, verified, _ = (a - b for a, b in zip(counters(llm), before))
    assert got == expected
    assert 0 < proposed and verified < proposed
    # drafts came once (after the prefill), were cut, and the proposer was skipped after that
    assert proposed <= len(PARAMS) * K


def test_the_engine_times_its_host_work_per_step_for_the_policy(target, scripted_plugin, expected):
    """With asynchronous scheduling the engine core tells the policy how long each decode
    iteration's host work took (its waits for results left out), by batch size and by whether
    the step verified drafts; the output is unchanged."""
    spec = {"method": "scripted-confidence", "num_speculative_tokens": K, "prompt_lookup_max": 3, "verification": "confidence"}
    llm = LLM(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=256, skip_tokenizer_init=True, speculative_config=spec,
              enable_prefix_caching=False, async_scheduling=True)  # fmt: skip
    use_costs(llm, StepCostModel.from_samples([1, 4096], [0.010, 0.0101]))  # drafting pays: both kinds of step come
    started = time.perf_counter()
    got = generate(llm, repetitive_prompts(len(PARAMS)), PARAMS)
    elapsed = time.perf_counter() - started
    assert got == expected
    policy = llm.llm_engine.core.scheduler.verification
    seen = {**policy.host_plain, **policy.host_verifying}
    assert seen and policy.host_verifying
    assert all(0 < seconds < elapsed for seconds in seen.values())
    assert set(seen) <= {n.bit_length() for n in range(1, len(PARAMS) + 1)}
    # a caller that lets the engine idle between two steps: the gap is not counted as host work
    policy.host_plain.clear()
    policy.host_verifying.clear()
    engine = llm.llm_engine
    engine.add_request("idle", {"prompt_token_ids": repetitive_prompts(1)[0]}, PARAMS[0])
    while engine.has_unfinished_requests():
        engine.step()
        time.sleep(0.3)
    # counted, a gap would make a step at least 0.3 s; a loaded machine may slow a step's own host work to a tenth of a second or more
    assert all(seconds < 0.25 for seconds in [*policy.host_plain.values(), *policy.host_verifying.values()])


def test_a_dspark_drafter_schedules_by_confidence_by_default_through_an_engine_core_process(target, expected, tmp_path):
    """The multi-process path (as ``sonar serve`` runs it): the resolved option crosses as
    JSON, the drafter's survival estimates reach the scheduler in the engine-core process,
    the counters come back in its stats."""
    import tempfile
    from pathlib import Path

    import zmq
    from transformers import AutoConfig

    from sonar.config import EngineArgs
    from sonar.engine import wire
    from sonar.engine.core_client import EngineProcesses
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform
    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter

    config = drafter_config_for(AutoConfig.from_pretrained(target), "deepspec", 4, 2, [-1, 1, 2], VOCAB - 1, markov_rank=16,
                                markov_head_type="vanilla", confidence_head=True)  # fmt: skip
    weights = load_file(str(target / "model.safetensors"))
    drafter = save_dflash(init_drafter(DFlashDrafter(config), std=0.1), tmp_path / "dspark", embedding=weights["model.embed_tokens.weight"],
                          lm_head=weights["lm_head.weight"])  # fmt: skip
    args = EngineArgs(str(target), kv_cache_memory_bytes=KV_BYTES, max_model_len=256, skip_tokenizer_init=True,
                      speculative_config={"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3})  # fmt: skip
    platform = current_platform()
    engine_config, _ = resolve_engine_config(args, platform)
    assert engine_config.speculative_config.verification == "confidence"
    prompt, params = repetitive_prompts(1)[0], PARAMS[0]
    ipc = Path(tempfile.mkdtemp(prefix="sonar-test-ipc-"))
    addresses = wire.ClientAddresses(f"ipc://{ipc}/in", f"ipc://{ipc}/out")
    context = zmq.Context()
    router, pull = context.socket(zmq.ROUTER), context.socket(zmq.PULL)
    router.bind(addresses.input)
    pull.bind(addresses.output)
    engines = EngineProcesses(engine_config, [addresses], platform.replica_env)
    try:
        assert router.poll(120_000), "the engine core said it is ready"
        identity, kind, _ = router.recv_multipart()
        assert kind == wire.READY
        router.send_multipart([identity, *wire.encode_request(wire.EngineCoreRequest("r", prompt, params, params.max_tokens, 0.0))])
        tokens: list[int] = []
        stats = None
        while len(tokens) < params.max_tokens:
            assert pull.poll(60_000)
            frames = pull.recv_multipart()
            if frames[0] != wire.OUTPUTS:
                continue
            decoded = wire.decode_outputs(frames)
            stats = decoded.stats
            for output in decoded.outputs:
                tokens += output.new_token_ids
        assert tokens == expected[0]
        deadline = time.monotonic() + 5
        while stats.spec_num_proposed_tokens == 0 and time.monotonic() < deadline:  # a heartbeat carries the last step's
            if pull.poll(1000):
                frames = pull.recv_multipart()
                if frames[0] == wire.OUTPUTS:
                    stats = wire.decode_outputs(frames).stats
        assert stats.spec_num_proposed_tokens >= stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens
        assert stats.spec_num_proposed_tokens > 0
        assert sum(stats.spec_verified_per_position) == stats.spec_num_draft_tokens
    finally:
        engines.terminate()
        context.destroy(linger=0)


def test_metrics_carry_the_proposed_draft_tokens():
    from sonar.engine.wire import SchedulerStats
    from sonar_server.metrics import ServerMetrics

    stats = SchedulerStats(spec_num_proposed_tokens=40, spec_num_draft_tokens=12, spec_num_accepted_tokens=7)
    text = ServerMetrics(lambda: stats, lambda: 0, "m").render().decode()
    assert 'sonar:spec_decode_num_proposed_tokens_total{model_name="m"} 40.0' in text
    assert 'sonar:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text


@pytest.mark.cuda
def test_cuda_profiles_its_step_cost_through_the_graphs_and_keeps_greedy_output(target, expected, scripted_plugin):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine
    from sonar_cuda.platform import CudaPlatform

    spec = {"method": "scripted-confidence", "num_speculative_tokens": K, "prompt_lookup_max": 3, "verification": "confidence"}
    args = EngineArgs(model=str(target), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256, skip_tokenizer_init=True,
                      speculative_config=spec)  # fmt: skip
    engine = LLMEngine(args, platform=CudaPlatform)
    costs = engine.core.step_costs
    assert costs.num_tokens[0] == 1 and costs.num_tokens[-1] == engine.config.max_num_batched_tokens  # the whole grid within 20 s
    assert costs.cost(costs.num_tokens[-1]) > costs.cost(1)
    for i, prompt in enumerate(repetitive_prompts(len(PARAMS))):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS[i])
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert [done[str(i)] for i in range(len(PARAMS))] == expected
    stats = engine.get_stats()
    assert stats.spec_num_proposed_tokens >= stats.spec_num_draft_tokens > 0
