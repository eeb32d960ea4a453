"""Verify steps of speculative decoding through the decode graphs' static buffers: a request
with k drafts takes k + 1 rows, each attending up to its own position. On CPU the layout runs
eagerly through Triton's interpreter; on a GPU (``cuda``) the graphs replay it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import InterpretedCudaPlatform, generate, run_to_end, use_tokenizer_folder_if_needed

from sonar import registry
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.sampling_params import SamplingParams
from sonar.spec_decode import DraftTokens, Proposer, ProposerInputs
from sonar_models.testing import build_tiny_model

PROMPT_LEN = 16


class ScriptedProposer(Proposer):
    """Drafts each request's known greedy continuation, with every third draft position wrong,
    so steps accept some drafts and reject others."""

    continuations: dict[tuple[int, ...], list[int]] = {}

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        k = self.config.num_speculative_tokens
        drafts = []
        for tokens in inputs.token_ids:
            expected = self.continuations.get(tuple(tokens[:PROMPT_LEN]), [])
            done = len(tokens) - PROMPT_LEN
            guess = expected[done : done + k]
            drafts.append([t if (done + i) % 3 != 2 else (t + 1) % 256 for i, t in enumerate(guess)])
        return DraftTokens(inputs.req_ids, drafts)


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("scripted", ScriptedProposer)


@pytest.fixture
def scripted():
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="test-scripted-proposer")
    registry.clear_caches()
    try:
        yield ScriptedProposer
    finally:
        manager.unregister(name="test-scripted-proposer")
        registry.clear_caches()


def _platform():
    if torch.cuda.is_available():
        from sonar_cuda.platform import CudaPlatform

        return CudaPlatform
    return InterpretedCudaPlatform


def _run_recording_verify_layouts(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Run the requests to the end: each one's final output (in prompt order), and the rows
    of every verify step the runner laid out in the graphs' buffers."""
    runner = engine.core.executor.worker.model_runner
    layouts: list[int] = []
    build = runner._build_rows_batch
    runner._build_rows_batch = lambda states, counts, n: layouts.append(n) or build(states, counts, n)
    return [output.outputs[0] for output in run_to_end(engine, prompts, params)], layouts


def test_verify_graphs_reach_a_full_verify_step() -> None:
    """With speculation the largest decode graph holds every drafting request's k + 1 rows
    (within the step's budget and the cap); the sizes past 256 step by 64, 128, then 256."""
    from types import SimpleNamespace

    from sonar.spec_decode import SpeculativeConfig
    from sonar_cuda.decode_graphs import default_capture_sizes
    from sonar_cuda.model_runner import MAX_VERIFY_GRAPH_ROWS, graph_rows_bound

    def config(spec, max_num_seqs=256, budget=8192):
        return SimpleNamespace(speculative_config=spec, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)

    confidence = SpeculativeConfig("dspark", 7, verification="confidence")
    assert graph_rows_bound(config(None), 256) == 256
    assert graph_rows_bound(config(confidence, max_num_seqs=64), 256) == 512
    assert graph_rows_bound(config(confidence), 256) == MAX_VERIFY_GRAPH_ROWS
    assert graph_rows_bound(config(confidence, budget=1000), 256) == 1000
    assert graph_rows_bound(config(SpeculativeConfig("ngram", 3)), 256) == 256  # fixed: 32 requests draft (128 rows)
    assert graph_rows_bound(config(SpeculativeConfig("ngram", 7, disable_by_batch_size=64)), 256) == 512
    sizes = default_capture_sizes(2048)
    assert sizes[sizes.index(256) :] == [256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    large = sizes[sizes.index(64) :]
    assert all(b / a <= 1.25 for a, b in zip(large, large[1:]))  # past 64 rows, padding at most a quarter
    assert default_capture_sizes(1000)[-2:] == [896, 1000]


def test_verify_steps_in_the_graph_layout_keep_greedy_output(tmp_path, scripted, monkeypatch) -> None:
    """A request with drafts (and logprobs) beside one that cannot take them (a penalty),
    greedy: the same tokens and logprobs as plain decoding on the CPU platform;
    every verify step went through the graph layout (past the plain decode graphs' rows,
    held by the verify graphs); no block leaked."""
    from sonar_cpu.platform import CpuPlatform
    from sonar_cuda.model_runner import CudaModelRunner

    monkeypatch.setattr(CudaModelRunner, "max_graph_batch_size", 2)  # decode steps of two requests; verify steps take more rows

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    prompts = [[(i * 13 + j * 7) % 97 + 100 for j in range(PROMPT_LEN)] for i in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    params = [greedy.clone(logprobs=2), greedy.clone(repetition_penalty=1.3)]
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    expected, _ = generate(CpuPlatform, path, prompts, params, **kwargs)
    scripted.continuations = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, expected)}

    config = {"method": "scripted", "num_speculative_tokens": 3}
    engine = LLMEngine(EngineArgs(model=str(path), speculative_config=config, **kwargs), platform=_platform())
    done, layouts = _run_recording_verify_layouts(engine, prompts, params)
    for i, reference in enumerate(expected):
        assert done[i].token_ids == reference.outputs[0].token_ids
    for a, b in zip(done[0].logprobs, expected[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some kept, some rejected
    assert layouts, "no verify step used the graph layout"
    assert all(n > len(prompts) for n in layouts)  # the drafting requests' rows and the plain one's
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_drafter_reading_the_targets_states_drafts_for_every_request_of_a_graph_verify_step(tmp_path) -> None:
    """A DSpark drafter (random weights: its drafts are rejected) beside two requests whose
    verify steps go through the graph layout, fixed-length verification: the target's states
    of each request's own rows reach the drafter, so every step drafts for both requests (the
    layout's attention rows are one per token; the states must be found by request), and
    greedy output is unchanged."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
    from sonar_cpu.platform import CpuPlatform

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    hf = AutoConfig.from_pretrained(path)
    drafter_config = drafter_config_for(hf, "deepspec", 4, 1, [-1, 0], hf.vocab_size - 1, markov_rank=8, markov_head_type="vanilla", confidence_head=True)
    weights = load_file(str(path / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    save_dflash(init_drafter(DFlashDrafter(drafter_config), std=0.1, seed=0), tmp_path / "drafter",
                embedding=weights["model.embed_tokens.weight"], lm_head=lm_head)  # fmt: skip
    prompts = [[(i * 13 + j * 7) % 97 + 100 for j in range(PROMPT_LEN + 3 * i)] for i in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False)
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    expected, _ = generate(CpuPlatform, path, prompts, [greedy] * 2, **kwargs)

    config = {"method": "dspark", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3, "verification": "fixed"}
    engine = LLMEngine(EngineArgs(model=str(path), speculative_config=config, **kwargs), platform=_platform())
    done, layouts = _run_recording_verify_layouts(engine, prompts, [greedy] * 2)
    for i, reference in enumerate(expected):
        assert done[i].token_ids == reference.outputs[0].token_ids
    # both requests verified their drafts in every verify step (3 each until max_tokens leaves less room)
    assert layouts[:4] == [8] * 4 and all(n >= 4 for n in layouts)
    assert engine.get_stats().spec_num_drafts == 2 * len(layouts)


class PassingScriptedProposer(ScriptedProposer):
    drafts_between_passes = True


class _PassesPlugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("scripted-passes", PassingScriptedProposer)


def test_several_verify_passes_a_step_in_the_graph_layout_keep_greedy_output(tmp_path, monkeypatch) -> None:
    """``verify_passes``: a lone greedy request runs three verify passes a step through the
    graph layout (each drafted from the tokens the one before kept); the same tokens as plain
    decoding on the CPU platform, in fewer engine steps than verify passes, no block leaked."""
    from sonar_cpu.platform import CpuPlatform

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    prompts = [[(i * 13 + j * 7) % 97 + 100 for j in range(PROMPT_LEN)] for i in range(2)]
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    manager = get_plugin_manager()
    manager.register(_PassesPlugin(), name="test-scripted-passes")
    registry.clear_caches()
    try:
        for max_tokens in (13, 21):
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)]
            for prompt in prompts:
                expected, _ = generate(CpuPlatform, path, [prompt], params, **kwargs)
                PassingScriptedProposer.continuations = {tuple(prompt): list(expected[0].outputs[0].token_ids)}
                config = {"method": "scripted-passes", "num_speculative_tokens": 3, "verify_passes": 3}
                engine = LLMEngine(EngineArgs(model=str(path), speculative_config=config, **kwargs), platform=_platform())
                done, layouts = _run_recording_verify_layouts(engine, [prompt], params)
                assert done[0].token_ids == expected[0].outputs[0].token_ids
                stats = engine.get_stats()
                assert len(layouts) >= engine.core.num_steps_launched  # more verify passes than steps that verify (the prefill has none)
                assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
                assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        manager.unregister(name="test-scripted-passes")
        registry.clear_caches()


def _ngram_passes_run(path, prompt, params, chained: bool, chain_cls=None):
    """One n-gram engine with four verify passes a step (the passes queued on the device
    where ``chained``, with ``chain_cls`` doing the work between them; else the core
    runner's loop): the output, the engine."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "verify_passes": 4}
    kwargs = dict(dtype="float32", max_model_len=96, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    engine = LLMEngine(EngineArgs(model=str(path), speculative_config=config, **kwargs), platform=_platform())
    runner = engine.core.executor.worker.model_runner
    queued = []
    if chain_cls is not None:
        runner.pass_chain_cls = chain_cls
    if chained:
        further = runner._further_passes
        runner._further_passes = lambda step, batch, rows: queued.append(rows) or further(step, batch, rows)
    else:
        runner._chain_for = lambda step, batch, rows: None
    done = run_to_end(engine, [prompt], [params])[0].outputs[0]
    if chained:
        assert queued and type(runner._pass_chain) is chain_cls  # the device chain ran the passes
    return done, engine


def test_verify_passes_queued_on_the_device_match_plain_decoding_and_the_host_loop(tmp_path) -> None:
    """n-gram drafting on the device (``PassChain``): a lone greedy request's passes are queued
    at once; the same tokens as plain decoding, and the same passes and acceptance counts as
    the loop that reads each pass back, with ``max_tokens`` and stop tokens inside a step's
    passes; no block leaked. The work between passes in one launch (``NgramPassChain``, the
    runner's; test_cuda_ngram_passes checks it against the separate operations of
    ``PassChain``)."""
    from sonar_cpu.platform import CpuPlatform

    from sonar_cuda.kernels.ngram_passes import NgramPassChain

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    kwargs = dict(dtype="float32", max_model_len=96, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    phrase = [101, 150, 133, 177, 120, 199, 140]
    prompts = [phrase * 4, [300, 301] + phrase * 3 + [150, 133]]
    checked_stop = False
    for index, prompt in enumerate(prompts):  # the first: max_tokens and a stop token inside a step; the second: to the end
        base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
        expected, _ = generate(CpuPlatform, path, [prompt], [base], **kwargs)
        reference = list(expected[0].outputs[0].token_ids)
        fresh = [j for j in range(6, len(reference)) if reference[j] not in reference[:j]]  # a stop token first met mid-run
        stop = reference[fresh[0]] if fresh else None
        variants = [base]
        if index == 0:
            variants = [SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, detokenize=False)]
            if stop is not None:
                variants.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], detokenize=False))
                checked_stop = True
        accepted = 0
        for params in variants:
            want, _ = generate(CpuPlatform, path, [prompt], [params], **kwargs)
            looped, host_engine = _ngram_passes_run(path, prompt, params, chained=False)
            assert looped.token_ids == want[0].outputs[0].token_ids
            host_stats = host_engine.get_stats()
            for chain_cls in (NgramPassChain,):
                chained, engine = _ngram_passes_run(path, prompt, params, chained=True, chain_cls=chain_cls)
                assert chained.token_ids == looped.token_ids
                stats = engine.get_stats()
                counts = [(s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.num_steps) for s in (stats, host_stats)]
                assert counts[0] == counts[1], chain_cls
                assert stats.num_free_blocks == stats.num_total_blocks
            accepted += stats.spec_num_accepted_tokens
        assert accepted > 0
    assert checked_stop, reference
