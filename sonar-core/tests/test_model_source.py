"""Model names: Hub ids from a Hugging Face cache laid out on disk (never the network), the
checks made from a model's files before loading, and default sampling from the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sonar.config import EngineArgs, default_model_path
from sonar.engine.generation_defaults import default_sampling_of
from sonar.engine.model_source import check_remote_code, context_length_of, resolve_model_path

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sonar_models.testing import build_tiny_model

    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny") / "qwen3")


def fake_hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """``root`` laid out as huggingface_hub lays out its cache, holding ``model`` at main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return repo / "snapshots" / SHA


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_from_the_cache_offline(tmp_path: Path, tiny_folder: Path, offline: None) -> None:
    snapshot = fake_hub_cache(tmp_path, "org/tiny-qwen3", tiny_folder)
    resolved = resolve_model_path("org/tiny-qwen3", download_dir=str(tmp_path))
    assert resolved == snapshot
    assert json.loads((resolved / "config.json").read_text())["model_type"] == "qwen3"
    assert resolve_model_path("org/tiny-qwen3", revision=SHA, download_dir=str(tmp_path)) == snapshot


def test_a_hub_id_through_the_engine_generates(tmp_path: Path, tiny_folder: Path, offline: None) -> None:
    from sonar import LLM, SamplingParams

    fake_hub_cache(tmp_path, "org/tiny-qwen3", tiny_folder)
    llm = LLM("org/tiny-qwen3", download_dir=str(tmp_path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    assert llm.llm_engine.config.served_name == "org/tiny-qwen3"
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_missing_hub_id_offline_says_so(tmp_path: Path, offline: None) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model_path("org/not-there", download_dir=str(tmp_path))
    message = str(error.value)
    assert "org/not-there is not in the Hugging Face cache" in message
    assert str(tmp_path) in message and "HF_HUB_OFFLINE" in message


def test_a_path_that_is_no_hub_id_is_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere" / "model.gguf"))


def test_remote_code_is_refused_unless_trusted(tmp_path: Path, tiny_folder: Path) -> None:
    folder = tmp_path / "custom"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--trust-remote-code"):
        check_remote_code(folder, trust_remote_code=False)
    check_remote_code(folder, trust_remote_code=True)
    check_remote_code(tiny_folder, trust_remote_code=False)


def test_context_length_from_the_files_alone(tiny_folder: Path) -> None:
    expected = json.loads((tiny_folder / "config.json").read_text())["max_position_embeddings"]
    assert context_length_of(tiny_folder) == expected
    assert context_length_of(Path(default_model_path())) == 8192  # SmolLM2's GGUF header


def test_a_yarn_config_reaches_its_stretched_context(tmp_path: Path, tiny_folder: Path) -> None:
    folder = tmp_path / "yarn"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)  # as Qwen3's published config.json: rope_theta and rope_scaling
    config.update(max_position_embeddings=40960, rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    (folder / "config.json").write_text(json.dumps(config))
    assert context_length_of(folder) == 131072


def test_generation_config_gives_the_default_sampling(tmp_path: Path, tiny_folder: Path) -> None:
    folder = tmp_path / "with-generation-config"
    shutil.copytree(tiny_folder, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 2})
    )
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert default_sampling_of(folder) == expected
    assert default_sampling_of(folder, "vllm") == {}
    assert default_sampling_of(tiny_folder, str(folder)) == expected
    assert default_sampling_of(Path(default_model_path())) == {"temperature": 0.2, "top_p": 0.9}
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling_of(folder, str(tmp_path / "empty"))


def test_llm_defaults_come_from_the_model_and_explicit_params_win(tmp_path: Path, tiny_folder: Path) -> None:
    from sonar import LLM, SamplingParams

    folder = tmp_path / "with-generation-config"
    shutil.copytree(tiny_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(folder), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    assert len(llm.generate(prompt)[0].outputs[0].token_ids) <= 3
    explicit = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(explicit[0].outputs[0].token_ids) == 6
    assert EngineArgs().generation_config == "auto"
