"""Rotary scalings against transformers: YaRN, dynamic NTK and LongRoPE frequencies and
attention factors against transformers' own initialisers, whole models with each scaling
against transformers token by token, and the context each scaling stretches to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sonar.engine.model_source import stretched_context
from sonar_models.rope import RotaryEmbedding, attention_factor, inverse_frequencies, position_frequencies, rope_spec_from_config
from sonar_models.testing import PagedCacheDriver, build_tiny_model, load_sonar_model

HEAD_DIM = 64
LONGROPE = {"short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)], "long_factor": [1.0 + 0.4 * i for i in range(HEAD_DIM // 2)]}
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", **LONGROPE, "original_max_position_embeddings": 512},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
}


def hf_config(scaling: dict, **fields) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=2048,
        rope_parameters={"rope_theta": 10000.0, **scaling}, **fields,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_match_transformers(name: str) -> None:
    config = hf_config(dict(SCALINGS[name]))
    spec = rope_spec_from_config(config, HEAD_DIM)
    rope_type = config.rope_parameters["rope_type"]
    expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(spec), expected.float(), atol=0, rtol=1e-6)
    assert attention_factor(spec) == pytest.approx(expected_factor)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_each_position_takes_transformers_frequencies_for_its_length(name: str) -> None:
    config = hf_config(dict(SCALINGS[name]))
    spec = rope_spec_from_config(config, HEAD_DIM)
    positions = torch.tensor([0, 100, 511, 512, 513, 2047, 2048, 3000, 5000])
    rows = position_frequencies(spec, positions)
    for position, row in zip(positions.tolist(), rows):
        expected, _ = ROPE_INIT_FUNCTIONS[name](config, "cpu", seq_len=position + 1)
        torch.testing.assert_close(row, expected.float(), atol=0, rtol=1e-5, msg=f"position {position}")


def test_cos_and_sin_carry_transformers_angles_and_attention_factor() -> None:
    """Both paths (the per-position table platform kernels read, and the module's direct
    output) against transformers' frequencies for each position's length, times its factor."""
    for name in ("yarn_mscale", "longrope", "dynamic"):
        config = hf_config(dict(SCALINGS[name]))
        spec = rope_spec_from_config(config, HEAD_DIM)
        rope = RotaryEmbedding(spec, 4096)
        positions = torch.tensor([0, 7, 600, 3000])
        rope_type = config.rope_parameters["rope_type"]
        expected_cos, expected_sin = [], []
        for position in positions.tolist():
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=position + 1)
            angles = position * inv_freq.float()
            expected_cos.append(angles.cos() * factor)
            expected_sin.append(angles.sin() * factor)
        half = spec.rotary_dim // 2
        table = rope.cos_sin_cache(torch.device("cpu"))[positions]
        cos, sin = rope(positions, torch.float32)
        for got_cos, got_sin in ((table[:, :half], table[:, half:]), (cos[:, :half], sin[:, :half])):
            torch.testing.assert_close(got_cos, torch.stack(expected_cos), atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(got_sin, torch.stack(expected_sin), atol=1e-5, rtol=1e-5, msg=name)


def test_a_stretching_scaling_stretches_the_context() -> None:
    assert stretched_context(40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}) == 131072
    assert stretched_context(2048, {"rope_type": "dynamic", "factor": 2.0}) == 4096
    assert stretched_context(2048, {"rope_type": "linear", "factor": 4.0}) == 8192
    assert stretched_context(131072, {"rope_type": "longrope", "original_max_position_embeddings": 4096, **LONGROPE}) == 131072
    assert stretched_context(131072, SCALINGS["llama3"]) == 131072
    assert stretched_context(2048, None) == 2048


def decode_against_transformers(path: Path, prompt: list[int], steps: int) -> None:
    """Prefill ``prompt``, then decode ``steps`` tokens one at a time, each step's logits
    against transformers' incremental pass over the same cache positions."""
    ours = load_sonar_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    driver = PagedCacheDriver(ours, block_size=4)
    tokens = list(prompt)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    logits = ours.compute_logits(driver.step(ours, [(0, prompt)]))
    torch.testing.assert_close(logits, out.logits[0].float(), atol=1e-4, rtol=0)
    past = out.past_key_values
    for _ in range(steps):
        token = int(logits[-1].argmax())
        tokens.append(token)
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = ours.compute_logits(driver.step(ours, [(0, [token])]))
        torch.testing.assert_close(logits[-1], out.logits[0, -1].float(), atol=1e-4, rtol=0, msg=f"position {len(tokens) - 1}")


PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 1345, 314]


@pytest.mark.parametrize(
    "arch, max_positions, scaling",
    [
        ("qwen3", 16, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
        ("llama", 16, {"rope_type": "dynamic", "factor": 3.0}),
        # as Phi-3 configs: max_position_embeddings the extended length, the pretraining one beside it
        ("llama", 64, {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 16}),
    ],
    ids=["yarn", "dynamic", "longrope"],
)
def test_models_with_each_scaling_decode_like_transformers_past_the_original_length(arch: str, max_positions: int, scaling: dict, tmp_path: Path) -> None:
    # a 12-token prompt inside the scaling's threshold (16 positions; yarn's 8 is position-free), decode steps across it
    path = build_tiny_model(arch, tmp_path / arch, max_position_embeddings=max_positions, rope_scaling=scaling)
    decode_against_transformers(path, PROMPT, steps=10)
