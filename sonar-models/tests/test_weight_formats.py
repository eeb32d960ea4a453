"""Weight formats: detection, sharded folders, dummy weights, and the loader's errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sonar.model_interface import make_attention_factory
from sonar.registry import model_architectures, weight_formats
from sonar_models.formats import DummyFormat, GGUFFormat, SafetensorsFormat
from sonar_models.llama import LlamaForCausalLM
from sonar_models.testing import PagedCacheDriver, load_sonar_model, smollm2_gguf_path

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30]


def logits_of(model: torch.nn.Module, token_ids: list[int] = PROMPT) -> torch.Tensor:
    return model.compute_logits(PagedCacheDriver(model).step(model, [(0, token_ids)]))


def test_architectures_and_formats_are_registered() -> None:
    ours = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    assert ours <= set(model_architectures())
    names = list(weight_formats())
    assert [n for n in names if n in ("safetensors", "gguf", "dummy")] == ["safetensors", "gguf", "dummy"]


def test_detection(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder, gguf = tiny_model_dirs["llama"], smollm2_gguf_path()
    assert SafetensorsFormat().detect(folder) and not SafetensorsFormat().detect(gguf)
    assert GGUFFormat().detect(gguf) and not GGUFFormat().detect(folder)
    assert not DummyFormat().detect(folder) and not DummyFormat().detect(gguf)
    shutil.copy(folder / "config.json", tmp_path / "config.json")  # config alone: nothing detects it
    assert not SafetensorsFormat().detect(tmp_path)


def test_sharded_folder_gives_the_same_logits(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = tiny_model_dirs["qwen3"]
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, single = logits_of(load_sonar_model(tmp_path)), logits_of(load_sonar_model(source))
    torch.testing.assert_close(sharded, single, atol=0, rtol=0)


def test_dummy_weights_from_a_config_only_folder(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(tiny_model_dirs["qwen2"] / "config.json", tmp_path / "config.json")
    fmt = DummyFormat()
    assert fmt.load_tokenizer(tmp_path) is None
    first, second = load_sonar_model(tmp_path, fmt), load_sonar_model(tmp_path, fmt)
    norm = first.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    qkv = first.model.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < qkv.std().item() < 0.025
    assert torch.equal(logits_of(first), logits_of(second))  # seeded: the same every time
    assert torch.isfinite(logits_of(first)).all()


def test_dummy_reads_a_tokenizer_where_there_is_one(tiny_model_dirs: dict[str, Path]) -> None:
    tokenizer = DummyFormat().load_tokenizer(tiny_model_dirs["llama"])
    assert tokenizer is not None and len(tokenizer) == 49152


def tiny_llama(tiny_model_dirs: dict[str, Path]) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    fmt = SafetensorsFormat()
    config = fmt.load_hf_config(tiny_model_dirs["llama"])
    weights = dict(fmt.iter_weights(tiny_model_dirs["llama"], config))
    return LlamaForCausalLM(config, make_attention_factory(None)), weights


def test_unknown_tensor_name_is_an_error(tiny_model_dirs: dict[str, Path]) -> None:
    model, weights = tiny_llama(tiny_model_dirs)
    weights["model.layers.0.self_attn.w_pack.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="w_pack.*no matching parameter"):
        model.load_weights(weights.items())


def test_shape_mismatch_is_an_error(tiny_model_dirs: dict[str, Path]) -> None:
    model, weights = tiny_llama(tiny_model_dirs)
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(64, 64\).*\(32, 64\)"):
        model.load_weights(weights.items())


def test_missing_tensor_is_an_error(tiny_model_dirs: dict[str, Path]) -> None:
    model, weights = tiny_llama(tiny_model_dirs)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"did not provide 1 parameters: .*gate_up_proj.weight\[up\]"):
        model.load_weights(weights.items())


def test_rotary_buffers_in_old_checkpoints_are_ignored(tiny_model_dirs: dict[str, Path]) -> None:
    model, weights = tiny_llama(tiny_model_dirs)
    model.load_weights(weights.items())
    expected = logits_of(model)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    model.load_weights(weights.items())
    torch.testing.assert_close(logits_of(model), expected, atol=0, rtol=0)  # the zeros changed nothing
