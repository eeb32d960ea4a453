"""LoRA adapters over HTTP: ``--lora-modules``, the adapter chosen by ``model`` in the OpenAI,
Anthropic and Kobold surfaces, ``/v1/models``, and runtime loading confined to ``--lora-root``.

Adapters are made by ``peft`` on the tiny Llama (``init_lora_weights=False``, so they change
the output) and saved in PEFT's layout; what the server generates through one equals the
peft-merged model's greedy output in transformers. One ``sonar serve`` runs every end-to-end
test here; the routes' absence without ``--allow-runtime-lora-updating`` uses the shared one.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess
from sonar.cli.main import build_parser, parse_args
from sonar_server.args import check_server_args
from sonar_server.lora import LoRAModule, LoRAPathError, check_adapter_name, confine_adapter_path, parse_lora_module

API_KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT_IDS = [1, 422, 3054, 7093, 17107, 9, 3711, 23]
NUM_TOKENS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, folder: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT adapter on ``base`` with random A and B (so it changes the output), saved in
    PEFT's layout (adapter_config.json, adapter_model.safetensors)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


def peft_greedy(base: str, adapter: Path | None, prompt_ids: list[int], num_tokens: int = NUM_TOKENS) -> str:
    """The peft-merged model's greedy text in transformers (the base model's without ``adapter``)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    return tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


# -- --lora-modules and adapter names --------------------------------------------------------


def test_lora_modules_take_name_equals_path_and_vllms_json_form() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "org/chat-v2", "path": "rel/chat", "base_model_name": "base"}') == LoRAModule("org/chat-v2", "rel/chat", "base")
    for bad, message in [
        ("sql", "is not name=path"),
        ("=/x", "is not name=path"),
        ("{not json", "is not valid JSON"),
        ('{"name": "a"}', "path must be a non-empty string"),
        ('{"name": "a", "path": 3}', "path must be a non-empty string"),
        ('{"name": "a", "path": "p", "extra": 1}', "unknown key(s) ['extra']"),
        ("a b=/x", "is not allowed"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
            parse_lora_module(bad)


def test_adapter_names_are_printable_and_bounded() -> None:
    for good in ["sql", "org/adapter-v1.2", "a:b@c+d_e"]:
        assert check_adapter_name(good) == good
    for bad in ["", "a\nb", "a\x00", "tab\tname", "spa ce", "-leading", "x" * 129, "quote'", "ünïcode"]:
        with pytest.raises(ValueError, match="is not allowed"):
            check_adapter_name(bad)
    with pytest.raises(ValueError, match="must be a string, got int"):
        check_adapter_name(7)


def serve_args(*argv: str) -> argparse.Namespace:
    return parse_args(build_parser(), ["serve", *argv])


def test_lora_flags_are_checked_before_loading(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cases = [
        (["--lora-modules", f"a={adapter}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --lora-root"),
        (["--enable-lora", "--lora-root", str(tmp_path / "missing")], "is not a folder"),
        (["--enable-lora", "--lora-modules", f"a={tmp_path / 'missing'}"], "--lora-modules 'a': "),
        (["--enable-lora", "--lora-modules", f"a={adapter}"], "holds no adapter_model.safetensors"),
        (["--enable-lora", "--lora-modules", f"a={adapter}", f"a={adapter}"], "names 'a' twice"),
        (["--enable-lora", "--served-model-name", "base", "--lora-modules", f"base={adapter}"], "is also a --served-model-name"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            check_server_args(serve_args(*argv))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    check_server_args(serve_args("--enable-lora", "--lora-modules", f"a={adapter}", "--allow-runtime-lora-updating", "--lora-root", str(tmp_path)))


# -- path confinement ------------------------------------------------------------------------


def _fake_adapter(folder: Path, weights: str = "adapter_model.safetensors") -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / weights).write_bytes(b"weights")
    return folder


@pytest.fixture()
def root_layout(tmp_path: Path) -> Path:
    """A --lora-root with a good adapter and every way out of it, made of real files."""
    root = tmp_path / "root"
    _fake_adapter(root / "good")
    _fake_adapter(root / "team" / "nested")
    outside = _fake_adapter(tmp_path / "outside")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "alias").symlink_to(root / "good", target_is_directory=True)
    leaky = root / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").write_text("{}")
    (leaky / "adapter_model.safetensors").symlink_to(tmp_path / "outside" / "adapter_model.safetensors")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"a": 1}))
    (root / "empty").mkdir()
    (root / "file").write_text("x")
    return root


def test_runtime_paths_stay_inside_the_lora_root(root_layout: Path) -> None:
    root = str(root_layout)
    real = os.path.realpath(root)
    assert confine_adapter_path(root, "good") == os.path.join(real, "good")
    assert confine_adapter_path(root, "team/nested") == os.path.join(real, "team", "nested")
    assert confine_adapter_path(root, str(root_layout / "good")) == os.path.join(real, "good")  # absolute, inside
    assert confine_adapter_path(root, "alias") == os.path.join(real, "good")  # a symlink that stays inside
    refused = {
        str(root_layout.parent / "outside"): "is outside --lora-root",
        "/etc": "is outside --lora-root",
        "../outside": "contains '..'",
        "good/../../outside": "contains '..'",
        "..\\outside": "contains '..'",
        "escape": "leads out of --lora-root",
        "leaky": "is a symlink that leads out of --lora-root",
        "pickled": "adapter_model.bin, a pickle",
        "empty": "holds no adapter_config.json",
        "file": "is not a folder",
        "missing": "does not exist",
        "": "must be 1 to",
        "x" * 5000: "must be 1 to",
        "good\x00": "control characters",
        "good\n": "control characters",
    }
    for requested, message in refused.items():
        with pytest.raises(LoRAPathError, match=message.replace("(", r"\(")) as info:
            confine_adapter_path(root, requested)
        assert real not in str(info.value) or requested.startswith(real), f"{requested!r}: the error shows where the root is"
    for not_a_string in [3, None, ["good"], {"path": "good"}]:
        with pytest.raises(LoRAPathError, match="must be a string"):
            confine_adapter_path(root, not_a_string)
