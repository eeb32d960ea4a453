"""LoRA through the CUDA platform's runner: prefill, then decode steps laid out in the static
graph buffers (run eagerly on CPU, padding rows included), the adapter slots written into the
persistent ``token_slots`` buffer, against the peft-merged model in transformers. (The Triton
shrink/expand have their own interpreter tests; here the torch versions run.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import HFOracle, InterpretedCudaPlatform, random_prompts, use_tokenizer_folder_if_needed

from sonar.config import EngineArgs
from sonar.engine.llm_engine import LLMEngine
from sonar.lora import LoRARequest
from sonar.sampling_params import SamplingParams
from sonar_models.testing import build_tiny_model

NUM_TOKENS = 5


def test_interpreted_runner_serves_an_adapter_beside_the_base_model(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only: Triton's interpreter is off where a GPU is present")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(str(tmp_path / "adapter"), safe_serialization=True)
    merged = HFOracle.__new__(HFOracle)
    merged.model = peft_model.merge_and_unload().eval()

    prompts = random_prompts(2, seed=5, min_len=3, max_len=10)
    engine = LLMEngine(
        EngineArgs(model=str(path), dtype="float32", enable_lora=True, max_model_len=128, kv_cache_memory_bytes=2 << 20),
        platform=InterpretedCudaPlatform,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    engine.add_request("adapter", {"prompt_token_ids": prompts[0]}, params, lora_request=adapter)
    engine.add_request("base", {"prompt_token_ids": prompts[1]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    expected = merged.greedy(prompts[0], NUM_TOKENS)
    assert done["adapter"] == expected
    assert done["base"] == HFOracle(path).greedy(prompts[1], NUM_TOKENS)
    assert expected != HFOracle(path).greedy(prompts[0], NUM_TOKENS)  # the adapter changes the output
    runner = engine.core.executor.worker.model_runner
    assert runner.graphs is not None and runner.lora is not None and runner.lora.num_activations == 1
