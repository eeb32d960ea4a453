"""Gemma 3's image-and-text checkpoints (Gemma3ForConditionalGeneration) served as text models:
a tiny one saved by transformers, and the same weights under the published naming
(``language_model.model.*``, ``vision_tower.*``), give transformers' greedy tokens and
log-probabilities on text prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HFOracle
from sonar import LLM, SamplingParams

KV_BYTES = 1 << 24
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    from sonar_models.testing import smollm2_tokenizer

    text = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2,
        max_position_embeddings=2048, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=49000)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # every norm and bias matters
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("gemma3") / "saved"
    model.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def published_naming(folder: Path, out: Path) -> Path:
    """The same weights under the names the published checkpoints use."""
    shutil.copytree(folder, out)
    renamed = {}
    for file in out.glob("*.safetensors"):
        for name, tensor in load_file(str(file)).items():
            if name.startswith("model.language_model."):
                name = "language_model.model." + name.removeprefix("model.language_model.")
            elif name.startswith("model."):
                name = name.removeprefix("model.")  # vision_tower.*, multi_modal_projector.*
            elif name == "lm_head.weight":
                continue  # tied: not saved
            renamed[name] = tensor
        file.unlink()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return out


def check(folder: Path, oracle: HFOracle) -> None:
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    assert llm.llm_engine.config.vocab_size == 49152
    for prompt in ([5, 900, 17, 3, 44, 8, 2, 19, 6, 33, 71, 12, 14], list(range(300, 340))):
        want, rows = oracle.greedy(prompt, NUM_TOKENS)
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        output = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        assert output.token_ids == want
        got = torch.tensor([entry[token].logprob for entry, token in zip(output.logprobs, want)])
        assert torch.allclose(got, torch.stack([row[t] for row, t in zip(rows, want)]), atol=1e-3)


def test_the_language_model_of_an_image_text_checkpoint_equals_transformers(checkpoint: Path, tmp_path: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    oracle = HFOracle.__new__(HFOracle)
    oracle.model = Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    check(checkpoint, oracle)
    check(published_naming(checkpoint, tmp_path / "published"), oracle)
