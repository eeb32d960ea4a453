"""LoRA on the CUDA platform (marker ``cuda``): the Triton shrink/expand in eager prefill and
in decode graphs captured with the LoRA path, the base-only graphs for steps without
adapters, greedy output equal to the peft-merged model in transformers."""

from __future__ import annotations

import pytest

from conftest import HFOracle, random_prompts
from sonar import SamplingParams
from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.lora import LoRARequest
from test_lora import ALL, make_adapter

NUM_TOKENS = 16


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """The merged model's ``NUM_TOKENS`` greedy tokens (this test's count, not test_lora's)."""
    oracle = HFOracle.__new__(HFOracle)
    oracle.model = model
    return oracle.greedy(prompt, NUM_TOKENS)[0]


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graphs_serve_adapters_and_the_base_model(tiny_model_dir, tmp_path, arch: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar_cuda.platform import CudaPlatform

    path = tiny_model_dir(arch)
    merged = {
        "all": make_adapter(path, tmp_path / "all", ALL, 8, seed=0),
        "qv": make_adapter(path, tmp_path / "qv", ["q_proj", "v_proj"], 4, seed=1),
    }
    requests = {"all": LoRARequest("all", 1, str(tmp_path / "all")), "qv": LoRARequest("qv", 2, str(tmp_path / "qv"))}
    prompts = random_prompts(6, seed=4, min_len=5, max_len=40)
    names = ["all", "qv", None, "all", None, "qv"]
    oracle = HFOracle(path)
    expected = [hf_greedy(merged[n], p) if n else oracle.greedy(p, NUM_TOKENS)[0] for p, n in zip(prompts, names)]

    engine = LLMEngine(
        EngineArgs(model=str(path), dtype="float32", enable_lora=True, max_loras=2, kv_cache_memory_bytes=64 << 20, max_model_len=256),
        platform=CudaPlatform,
    )
    runner = engine.core.executor.worker.model_runner
    assert runner.graphs.graphs and runner.graphs.lora_graphs  # both sets captured
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

    def generate(indices: list[int]) -> dict[int, list[int]]:
        for i in indices:
            lora = requests[names[i]] if names[i] else None
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params, lora_request=lora)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[int(output.request_id)] = output.outputs[0].token_ids
        return done

    got = generate(list(range(len(prompts))))
    assert [got[i] for i in range(len(prompts))] == expected
    alone = names.index("all")  # one row a step: the product and the shrink in one launch
    assert generate([alone])[alone] == expected[alone]
    base_only = [i for i, n in enumerate(names) if n is None]
    got = generate(base_only)
    assert [got[i] for i in base_only] == [expected[i] for i in base_only]
    assert not runner.lora.batch.active  # the last steps had no adapter: the LoRA path was off
