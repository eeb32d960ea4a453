"""Prompts through the decode graphs, one row a token (``CudaModelRunner.prompt_chunk_rows``):
a short prompt's prefill, the chunks of a longer one, and a prompt beside decoding requests
give the tokens and logprobs of the CPU platform's eager prefill. On CPU the layout runs
eagerly through Triton's interpreter; on a GPU the graphs replay it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import InterpretedCudaPlatform, generate, run_to_end, use_tokenizer_folder_if_needed

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.sampling_params import SamplingParams
from sonar_models.testing import build_tiny_model


def _platform():
    if torch.cuda.is_available():
        from sonar_cuda.platform import CudaPlatform

        return CudaPlatform
    return InterpretedCudaPlatform


def _recording_layouts(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """Every step the runner laid out one row a token: (requests, rows, requests sampled)."""
    runner = engine.core.executor.worker.model_runner
    layouts: list[tuple[int, int, int]] = []
    build = runner._build_rows_batch

    def recorded(states, counts, n):
        batch = build(states, counts, n)
        layouts.append((len(states), n, len(batch.sample_rows)))
        return batch

    runner._build_rows_batch = recorded
    return layouts


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.cuda), "gemma2"])  # the CPU: Gemma 2 (a window, capped scores)
def test_prompts_in_the_graph_layout_prefill_as_the_eager_path_does(tmp_path, arch, monkeypatch) -> None:
    """Three prompts (5, 11 and 23 tokens) under a step budget of 12 tokens, so the longest is
    prefilled in chunks, the first of them beside the others' decoding; greedy with logprobs:
    the CPU platform's tokens and logprobs. A chunk that does not reach its prompt's end is not
    sampled; a request wanting prompt logprobs is prefilled eagerly; no block leaked."""
    from sonar_cpu.platform import CpuPlatform
    from sonar_cuda.model_runner import CudaModelRunner

    monkeypatch.setattr(CudaModelRunner, "prompt_chunk_limit", None)  # the default, also in the interpreter
    use_tokenizer_folder_if_needed()
    path = build_tiny_model(arch, tmp_path / arch)
    prompts = [[(i * 13 + j * 7) % 97 + 100 for j in range(length)] for i, length in enumerate((5, 11, 23))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False, logprobs=2)
    params = [greedy, greedy, greedy]
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True,
                  max_num_batched_tokens=12, enable_prefix_caching=False)  # fmt: skip
    expected, _ = generate(CpuPlatform, path, prompts, params, **kwargs)

    engine = LLMEngine(EngineArgs(model=str(path), **kwargs), platform=_platform())
    layouts = _recording_layouts(engine)
    done = [output.outputs[0] for output in run_to_end(engine, prompts, params)]
    for got, reference in zip(done, expected, strict=True):
        assert got.token_ids == reference.outputs[0].token_ids
        for a, b in zip(got.logprobs, reference.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    assert layouts, "no prompt went through the graph layout"
    assert any(rows > requests for requests, rows, _ in layouts)  # a prompt of several tokens in one step
    assert any(sampled < requests for requests, _, sampled in layouts)  # a chunk short of its prompt's end
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks

    # prompt logprobs read every prompt position's logits: that prefill stays eager
    layouts.clear()
    wanting = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False, prompt_logprobs=1)
    (output,) = run_to_end(engine, prompts[1:2], [wanting])
    assert len(output.prompt_logprobs) == len(prompts[1])
    assert not layouts
