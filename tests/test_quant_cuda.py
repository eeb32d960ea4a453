"""Every quantization format end to end on the CUDA platform (marker ``cuda``): the engine in
bfloat16 with the GPU kernels (one-row GEMV at batch 1, the batched products for several
prompts, CUDA graphs) against transformers in float32 on the same dequantized weights.

bfloat16 activations move log-probabilities, so each generated token is checked teacher-forced:
it is transformers' argmax wherever transformers' top two are more than ``TIE_NATS`` apart,
and its log-probability is within ``LOGPROB_TOL``. For the FP8 formats transformers quantizes
each projection's input per token as the scheme does (the CPU tests' emulation), so only the
bfloat16 arithmetic differs; int4 scales are held in bfloat16 at run time (fp16 on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import HFOracle, random_prompts
from int4_quantizer import write_int4_checkpoint
from sonar import LLM, SamplingParams
from sonar_models.testing import build_tiny_model
from test_quant_fp8 import compressed_tensors_config, emulate_activations, per_channel, write_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
NUM_TOKENS = 10
TIE_NATS = 0.3
# int4: bf16 activations and bf16 scales (measured up to 0.155 on an H200). FP8: a bf16
# activation that rounds to a different E4M3 value than its float32 twin moves by a whole FP8
# step (6%), so bf16 differences are amplified: 0.225 measured against the emulated oracle
LOGPROB_TOL = {"gptq": 0.2, "awq": 0.2, "compressed-tensors": 0.3, "fp8": 0.3}


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("quant-cuda") / "llama", **TINY)


def checkpoint(kind: str, source: Path, root: Path) -> tuple[Path, Path, dict]:
    """``(folder the engine loads, dequantized float folder, extra LLM options)``."""
    if kind in ("gptq", "awq"):
        quantized, dequantized = write_int4_checkpoint(source, root, fmt=kind, group_size=128, sym=kind == "gptq")
        return quantized, dequantized, {}
    if kind == "compressed-tensors":
        quantized, dequantized = write_checkpoint(source, root, per_channel, compressed_tensors_config("channel", False))
        return quantized, dequantized, {}
    # quantized at load, one scale per output channel: the oracle runs those weights dequantized
    _, dequantized = write_checkpoint(source, root, per_channel, compressed_tensors_config("channel", False))
    return source, dequantized, {"quantization": "fp8"}


def check_against_transformers(kind: str, oracle: HFOracle, prompt: list[int], tokens: list[int], logprobs: list[dict]) -> None:
    with torch.inference_mode():
        logits = oracle.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], -1)
    for step, (token, row, returned) in enumerate(zip(tokens, rows, logprobs)):
        top2 = torch.topk(row, 2)
        if float(top2.values[0] - top2.values[1]) > TIE_NATS:
            assert token == int(top2.indices[0]), f"{kind} step {step}: {token} is not transformers' clear argmax"
        assert abs(returned[token].logprob - float(row[token])) < LOGPROB_TOL[kind], (kind, step)


@pytest.mark.parametrize("kind", ["gptq", "awq", "compressed-tensors", "fp8"])
def test_format_runs_on_the_gpu_like_transformers(kind: str, tiny_float: Path, tmp_path: Path) -> None:
    quantized, dequantized, options = checkpoint(kind, tiny_float, tmp_path)
    llm = LLM(str(quantized), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=16 << 20, **options)
    assert llm.llm_engine.config.quantization == kind
    oracle = HFOracle(dequantized)
    if kind in ("compressed-tensors", "fp8"):
        emulate_activations(oracle, "token")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    prompts = random_prompts(4, seed=17, min_len=4, max_len=40)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params)  # batch 1: the one-row kernels
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # batched products
    for prompt, output in [(prompts[0], alone[0]), *zip(prompts, together)]:
        completion = output.outputs[0]
        check_against_transformers(kind, oracle, prompt, completion.token_ids, completion.logprobs)
