"""A config saved without an ``architectures`` list resolves by its ``model_type``."""

from __future__ import annotations

import json
import shutil

import pytest

from sonar import LLM, SamplingParams
from sonar.registry import architecture_of


def test_a_bare_config_runs_by_its_model_type(tmp_path) -> None:
    from sonar_models.testing import build_tiny_model

    named = tmp_path / "named"
    build_tiny_model("qwen3", named)
    bare = tmp_path / "bare"
    shutil.copytree(named, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["architectures"]
    (bare / "config.json").write_text(json.dumps(config))

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = [
        LLM(str(folder), kv_cache_memory_bytes=4 * 1024 * 1024, max_model_len=128).generate([[3, 4, 5, 6]], params)[0]
        for folder in (named, bare)
    ]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert len(outputs[1].outputs[0].token_ids) == 8


def test_an_unknown_model_type_names_what_is_registered() -> None:
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = "mamba"
    with pytest.raises(ValueError, match=r"model_type 'mamba'.*registered architectures: \[.*LlamaForCausalLM"):
        architecture_of(config)
