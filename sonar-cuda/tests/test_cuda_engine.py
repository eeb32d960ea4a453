"""The whole engine on the CUDA platform's worker (graphs, static decode buffers, Triton
attention and ops) against transformers on tiny random models.

On CPU the runner and attention run through Triton's interpreter (the decode path still goes
through the static buffers, eagerly); on a GPU the ``cuda`` tests run every architecture in
float32 (token-for-token equal) and bfloat16 (top-5 logprobs within bf16 tolerance).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import ARCHS, HFOracle, InterpretedCudaPlatform, generate, random_prompts, use_tokenizer_folder_if_needed

from sonar import ops
from sonar.sampling_params import SamplingParams
from sonar_models.testing import MOE_ARCHS, PagedCacheDriver, build_tiny_model, load_sonar_model

BF16_LOGPROB_TOL = 0.15  # |ours - float32 transformers| per top-5 entry, bf16 weights and activations


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    use_tokenizer_folder_if_needed()
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, root / arch)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])  # gemma2: the kernels' cap on attention scores, sliding layers
def test_interpreted_engine_matches_transformers(tiny_models, arch: str) -> None:
    """Prefill, chunked prefill and static-buffer decode steps, greedy, on CPU."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only: Triton's interpreter is off where a GPU is present")
    path = tiny_models(arch)
    prompts = random_prompts(3, seed=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs, engine = generate(
        InterpretedCudaPlatform, path, prompts, params,
        dtype="float32", max_model_len=128, max_num_batched_tokens=32, kv_cache_memory_bytes=2 << 20,
    )
    oracle = HFOracle(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == oracle.greedy(prompt, 6)
    runner = engine.core.executor.worker.model_runner
    assert runner.graphs is not None and not runner.graphs.graphs  # no graphs on CPU, same buffers
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_platform_ops_in_the_model_match_transformers(tiny_models, arch: str) -> None:
    """The Triton norms, rotary and activation behind ``sonar.ops`` (interpreted on CPU)."""
    from sonar_cuda.ops import OPS
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():
        pytest.skip("covered on the GPU by the engine tests")
    path = tiny_models(arch)
    prompt = random_prompts(1, seed=11, min_len=20, max_len=20)[0]
    model = load_sonar_model(path)
    ops.register_ops("cpu", OPS)
    try:
        driver = PagedCacheDriver(model, block_size=4)
        ours = model.compute_logits(driver.step(model, [(0, prompt)]))
    finally:
        ops.unregister_ops("cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS + list(MOE_ARCHS))  # MoE: the fused kernel behind sonar.moe
def test_float32_greedy_equals_transformers(tiny_models, arch: str) -> None:
    from sonar_cuda.platform import CudaPlatform

    path = tiny_models(arch)
    prompts = random_prompts(16, seed=(ARCHS + list(MOE_ARCHS)).index(arch), max_len=90)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for budget in (None, 48):  # 48: prefill chunks mixed with decodes
        outputs, engine = generate(
            CudaPlatform, path, prompts, params,
            dtype="float32", max_model_len=512, max_num_batched_tokens=budget, kv_cache_memory_bytes=64 << 20,
        )
        assert engine.core.executor.worker.model_runner.graphs.graphs, "decode graphs were captured"
        oracle = HFOracle(path)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == oracle.greedy(prompt, 32)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_top5_logprobs_match_transformers(tiny_models, arch: str) -> None:
    from sonar_cuda.platform import CudaPlatform

    path = tiny_models(arch)
    prompts = random_prompts(8, seed=100 + ARCHS.index(arch), max_len=90)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs, _ = generate(
        CudaPlatform, path, prompts, params, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20
    )
    oracle, bf16 = HFOracle(path), HFOracle(path, torch.bfloat16, "cuda")
    worst = worst_bf16 = 0.0  # ours, and transformers' own in bfloat16, against float32
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected = oracle.logprobs(prompt, completion.token_ids)  # teacher-forced on our tokens
        theirs = bf16.logprobs(prompt, completion.token_ids)
        for step, entry in enumerate(completion.logprobs):
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:5]
            for token_id, logprob in top:
                worst = max(worst, abs(logprob.logprob - float(expected[step, token_id])))
                worst_bf16 = max(worst_bf16, abs(float(theirs[step, token_id]) - float(expected[step, token_id])))
            assert completion.token_ids[step] in expected[step].topk(5).indices.tolist()
    # within the tolerance, or no further off than transformers itself in bfloat16 (Gemma's
    # scaled embeddings round coarser), by a quarter at most
    bound = max(BF16_LOGPROB_TOL, 1.25 * worst_bf16)
    assert worst < bound, f"largest top-5 logprob difference {worst:.3f} (transformers in bfloat16: {worst_bf16:.3f})"



@pytest.mark.cuda
def test_async_scheduling_gives_the_synchronous_outputs(tiny_models) -> None:
    """Steps launched before the previous one's tokens are read (fed on the device), through
    the decode graphs and the eager path: greedy, seeded, stop tokens, penalties, logprobs."""
    from sonar_cuda.platform import CudaPlatform

    path = tiny_models("qwen3")
    prompts = random_prompts(40, seed=7, max_len=90)
    engine_kwargs = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=96, kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference, _ = generate(CudaPlatform, path, prompts, greedy, async_scheduling=False, **engine_kwargs)
    kinds = [
        lambda i: greedy.clone(logprobs=2),
        lambda i: SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30 + i % 7, seed=i, ignore_eos=True),
        lambda i: greedy.clone(ignore_eos=False, stop_token_ids=[reference[i].outputs[0].token_ids[3 + i % 11]]),
        lambda i: greedy.clone(repetition_penalty=1.3, max_tokens=25),
        lambda i: SamplingParams(temperature=1.0, top_k=8, max_tokens=33, seed=100 + i, ignore_eos=True, logprobs=1),
    ]
    params = [kinds[i % len(kinds)](i) for i in range(len(prompts))]
    sync, _ = generate(CudaPlatform, path, prompts, params, async_scheduling=False, **engine_kwargs)
    overlapped, engine = generate(CudaPlatform, path, prompts, params, async_scheduling=True, **engine_kwargs)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    for a, b in zip(sync, overlapped):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        if a.outputs[0].logprobs:
            for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert step_a.keys() == step_b.keys()
                for token_id in step_a:
                    assert abs(step_a[token_id].logprob - step_b[token_id].logprob) < 1e-3
