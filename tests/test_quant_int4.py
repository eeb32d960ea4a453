"""GPTQ and AWQ int4 checkpoints in their real on-disk layouts (written by the small quantizer
in ``int4_quantizer``) run through ``LLM`` greedy-equal to transformers on the dequantized
weights, with top-5 logprobs within 2e-3; unsupported variants are refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import HFOracle, random_prompts
from int4_quantizer import write_int4_checkpoint
from sonar import LLM, SamplingParams
from sonar_models.testing import build_tiny_model

# every projection's dims are multiples of 8 and of the group sizes (q 256, k/v 128, mlp 512)
TINY_INT4 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
LOGPROB_TOLERANCE = 2e-3  # float32 on both sides, same weights: only summation order differs
NUM_TOKENS = 12

VARIANTS = {
    "gptq-sym-g128": dict(fmt="gptq", group_size=128, sym=True),
    "gptq-asym-g64-act-order": dict(fmt="gptq", group_size=64, sym=False, desc_act=True),
    "gptq-sym-per-channel-act-order": dict(fmt="gptq", group_size=-1, sym=True, desc_act=True),
    "gptq-asym-per-channel": dict(fmt="gptq", group_size=-1, sym=False),
    "awq-g128": dict(fmt="awq", group_size=128),
    "awq-g64": dict(fmt="awq", group_size=64),
}


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("int4-float") / "llama", **TINY_INT4)


@pytest.fixture(scope="module")
def checkpoint(tiny_float: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return write_int4_checkpoint(tiny_float, tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.mark.parametrize("checkpoint", list(VARIANTS), indirect=True)
def test_int4_checkpoint_runs_greedy_equal_to_transformers_on_dequantized_weights(checkpoint: tuple[Path, Path]) -> None:
    assert_runs_like_transformers(*checkpoint)


def assert_runs_like_transformers(quantized: Path, dequantized: Path) -> None:
    """Greedy tokens equal to transformers on the dequantized weights, top-5 logprobs within
    ``LOGPROB_TOLERANCE``."""
    llm = LLM(str(quantized), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    method = json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"]
    assert llm.llm_engine.config.quantization == method
    prompts = random_prompts(3, seed=41, min_len=4, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = HFOracle(dequantized)
    for prompt, output in zip(prompts, outputs):
        expected, rows = oracle.greedy(prompt, NUM_TOKENS)
        assert output.outputs[0].token_ids == expected
        for step, (logprobs, row) in enumerate(zip(output.outputs[0].logprobs, rows)):
            top = torch.topk(row, 5).indices.tolist()
            assert set(top) <= set(logprobs), f"step {step}: top-5 {top} not all returned"
            for token in top:
                assert abs(logprobs[token].logprob - float(row[token])) < LOGPROB_TOLERANCE, (step, token)


def _with_config(checkpoint: Path, **changes) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"].update(changes)
    (checkpoint / "config.json").write_text(json.dumps(config))
    return checkpoint


@pytest.mark.parametrize(
    "fmt, changes, message",
    [
        ("gptq", {"bits": 8}, "GPTQ with bits=8 is not supported; Sonar runs 4-bit GPTQ"),
        ("gptq", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
        ("gptq", {"group_size": 96}, r"256 inputs do not split into groups of 96"),
        ("awq", {"version": "gemv"}, "AWQ version 'gemv' is not supported; Sonar reads the 'gemm' packing"),
        ("awq", {"bits": 3}, "AWQ with bits=3 is not supported"),
    ],
)
def test_unsupported_int4_variants_are_refused_at_load(tiny_float: Path, tmp_path: Path, fmt: str, changes: dict, message: str) -> None:
    quantized, _ = write_int4_checkpoint(tiny_float, tmp_path, fmt, group_size=128)
    with pytest.raises(ValueError, match=message):
        LLM(str(_with_config(quantized, **changes)), dtype="float32", max_model_len=64, kv_cache_memory_bytes=2 << 20)
