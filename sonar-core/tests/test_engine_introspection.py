"""What the engine exposes to benchmarks: phase timing, device timings, the memory profile;
and the profile of the largest step the configuration allows."""

from __future__ import annotations

import pytest

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.sampling_params import SamplingParams
from sonar.worker.model_runner import profile_states, profile_step_peak_bytes


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("introspection")
    build_tiny_model("llama", folder)
    return LLMEngine(EngineArgs(model=str(folder), kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128, max_num_seqs=8))


def _run(engine: LLMEngine, count: int = 3) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(count):
        engine.add_request(f"timed-{id(engine)}-{i}-{engine.get_stats().num_steps}", [3 + i, 4, 5], params)
    while engine.has_unfinished_requests():
        engine.step()


def test_phase_timing_covers_the_step_and_switches_off(engine: LLMEngine) -> None:
    runner = engine.core.executor.worker.model_runner
    steps_before = engine.get_stats().num_steps
    engine.set_phase_timing(True)
    _run(engine)
    times = engine.phase_times()
    engine.set_phase_timing(False)
    assert engine.get_stats().num_steps - steps_before >= 4
    for label in ("schedule", "launch", "fetch_wait", "update", "output_processing", "launch: forward", "launch: sampler",
                  "launch: build_batch", "launch: sampling_metadata"):
        assert times.get(label, 0.0) > 0.0, label
    assert times["launch: forward"] < times["launch"]  # a part of the launch, not more than it
    # off again: the engine's own methods are back, nothing is timed
    assert "_update_states" not in runner.__dict__ and "forward" not in runner.model.__dict__
    _run(engine)
    assert engine.phase_times() == {}


def test_memory_profile_and_device_benchmarks_on_the_cpu(engine: LLMEngine) -> None:
    report = engine.memory_profile()
    assert report["kv_cache_bytes"] <= 4 * 1024 * 1024
    assert report["kv_cache_blocks"] == engine.core.cache_config.num_blocks
    assert engine.device_benchmarks() == {}  # nothing device-only to time on the CPU


def test_the_profile_step_runs_the_largest_shape_and_leaves_nothing(engine: LLMEngine) -> None:
    runner = engine.core.executor.worker.model_runner
    states, lengths = profile_states(engine.config, engine.config.vocab_size)
    config = engine.config
    assert sum(lengths) == min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    assert len(states) == config.max_num_seqs and max(lengths) <= config.max_model_len
    assert all(s.sampling.params.logprobs == engine.config.max_logprobs for s in states)
    rows_before = dict(runner.block_table.row_of)
    assert profile_step_peak_bytes(runner, engine.platform, states, lengths) == 0  # the CPU measures nothing
    assert runner.block_table.row_of == rows_before
    _run(engine)  # the engine still serves


def test_phase_timing_with_speculative_decoding_keeps_the_output(tmp_path_factory) -> None:
    """Timing wraps the sampler's ``sample``, not the sampler: a verify step still reaches its
    parts (``process``, ``final_probabilities``) and the tokens do not change."""
    from sonar_models.testing import build_tiny_model

    folder = tmp_path_factory.mktemp("introspection-spec")
    build_tiny_model("llama", folder)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = LLMEngine(EngineArgs(model=str(folder), kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128,
                                  speculative_config=spec))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]

    def generate(request_id: str) -> list[int]:
        engine.add_request(request_id, prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens = list(output.outputs[0].token_ids)
        return tokens

    plain = generate("plain")
    engine.set_phase_timing(True)
    timed = generate("timed")
    times = engine.phase_times()
    engine.set_phase_timing(False)
    assert timed == plain and len(timed) == 12
    assert times.get("launch: sampler", 0.0) > 0.0
    # the speculative parts are timed too, each inside the step part that runs it
    assert 0.0 < times["launch: spec_verify"] < times["launch"]
    assert 0.0 < times["fetch: spec_propose: proposer"] <= times["fetch: spec_propose"] < times["fetch_wait"]
    spec = engine.core.executor.worker.model_runner.spec
    assert "verify" not in spec.__dict__ and "propose" not in spec.proposer.__dict__  # unwrapped again
    assert engine.get_stats().spec_num_drafts > 0  # drafts were verified while timed
