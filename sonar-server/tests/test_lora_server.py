"""LoRA adapters over HTTP: ``--lora-modules``, the adapter chosen by ``model`` in the OpenAI,
Anthropic and Kobold surfaces, ``/v1/models``, and runtime loading confined to ``--lora-root``.

Adapters are made by ``peft`` on the tiny Llama (``init_lora_weights=False``, so they change
the output) and saved in PEFT's layout; what the server generates through one equals the
peft-merged model's greedy output in transformers. One ``sonar serve`` runs every end-to-end
test here; the routes' absence without ``--allow-runtime-lora-updating`` uses the shared one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pickle
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import KV_CACHE_BYTES, ServerProcess, sonar_command
from sonar.cli.main import build_parser, parse_args
from sonar_server.args import check_server_args
from sonar_server.lora import (
    LoRAModule,
    LoRAPathError,
    check_adapter_name,
    confine_adapter_path,
    parse_lora_module,
)

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
    env = {**os.environ, "SONAR_PLATFORM": "cpu"}
    started = time.monotonic()
    done = subprocess.run([*sonar_command(), "serve", "--enable-lora", "--lora-modules", f"a={adapter}"], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert "--lora-modules 'a': " in done.stderr and "holds no adapter_model.safetensors" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 5.0, "the adapter folder is checked before the model loads"
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


# -- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_files(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters and traps: ``sql`` (a --lora-modules adapter, outside the root), under the
    root ``chat`` (loaded at run time) and ``wide`` (rank 16, above the server's 8), and
    folders that are not adapters."""
    base = tmp_path_factory.mktemp("lora")
    root = base / "root"
    root.mkdir()
    files = {
        "root": root,
        "sql": make_adapter(tiny_model, base / "sql", seed=1),
        "chat": make_adapter(tiny_model, root / "chat", seed=2),
        "wide": make_adapter(tiny_model, root / "wide", seed=3, rank=16),
    }
    (root / "escape").symlink_to(files["sql"], target_is_directory=True)
    leaky = root / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").write_text((files["chat"] / "adapter_config.json").read_text())
    (leaky / "adapter_model.safetensors").symlink_to(files["sql"] / "adapter_model.safetensors")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((files["chat"] / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"base_model.model.lm_head.weight": [0.0]}))
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text("not json {")
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    return files


@pytest.fixture(scope="module")
def lora_server(tiny_model: str, lora_files: dict[str, Path]) -> Iterator[ServerProcess]:
    process = ServerProcess(
        [
            tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"sql={lora_files['sql']}",
            "--allow-runtime-lora-updating", "--lora-root", str(lora_files["root"]), "--api-key", API_KEY,
        ]
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def expected(tiny_model: str, lora_files: dict[str, Path]) -> dict[str, str]:
    """Greedy texts of PROMPT_IDS: the base model's and each adapter's, merged by peft."""
    return {name: peft_greedy(tiny_model, lora_files.get(name), PROMPT_IDS) for name in ("tiny", "sql", "chat")}


def complete(url: str, model: str, prompt: object = PROMPT_IDS, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_each_adapter_generates_what_the_peft_merged_model_does(lora_server: ServerProcess, expected: dict[str, str]) -> None:
    assert len(set(expected.values())) == 3, "the adapters must change the greedy output"
    for model in ("tiny", "sql"):
        response = complete(lora_server.url, model)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[model]
        assert response.json()["model"] == model


def test_models_lists_adapters_under_their_base(lora_server: ServerProcess, lora_files: dict[str, Path]) -> None:
    cards = httpx.get(f"{lora_server.url}/v1/models", headers=AUTH).json()["data"]
    by_id = {card["id"]: card for card in cards}
    assert list(by_id) == ["tiny", "sql"]
    assert by_id["sql"]["parent"] == "tiny"
    assert by_id["sql"]["root"] == str(lora_files["sql"])
    assert "parent" not in by_id["tiny"]


def test_sdks_choose_the_adapter_by_model(lora_server: ServerProcess) -> None:
    import anthropic
    import openai

    messages = [{"role": "user", "content": "Write SQL"}]
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0)
    chat = {m: client.chat.completions.create(model=m, messages=messages, max_tokens=NUM_TOKENS, temperature=0) for m in ("tiny", "sql")}
    assert chat["sql"].model == "sql"
    # the same rendered prompt through /v1/completions with the same adapter: the same text
    prompt_ids = httpx.post(f"{lora_server.url}/tokenize", json={"model": "sql", "messages": messages}, headers=AUTH).json()["tokens"]
    for model, response in chat.items():
        plain = httpx.post(
            f"{lora_server.url}/v1/completions", headers=AUTH,
            json={"model": model, "prompt": prompt_ids, "max_tokens": NUM_TOKENS, "temperature": 0},
        ).json()
        assert response.choices[0].message.content == plain["choices"][0]["text"]
    assert chat["tiny"].choices[0].message.content != chat["sql"].choices[0].message.content

    claude = anthropic.Anthropic(base_url=lora_server.url, api_key=API_KEY, max_retries=0)
    message = claude.messages.create(model="sql", messages=messages, max_tokens=NUM_TOKENS, extra_body={"temperature": 0})
    assert message.model == "sql"
    assert message.content[0].text == chat["sql"].choices[0].message.content
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="nope", messages=messages, max_tokens=NUM_TOKENS)
    assert info.value.body["error"]["type"] == "not_found_error"
    assert "'nope' is not served here" in info.value.body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info_openai:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert info_openai.value.body["type"] == "not_found_error"
    assert "'sql'" in info_openai.value.body["message"]  # the error lists what is served


def test_kobold_takes_the_adapter_from_a_model_field(lora_server: ServerProcess) -> None:
    prompt = "SELECT name FROM"
    texts = {}
    for model in ("sql", None):
        body = {"prompt": prompt, "max_length": NUM_TOKENS, "temperature": 0, **({"model": model} if model else {})}
        response = httpx.post(f"{lora_server.url}/api/v1/generate", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        texts[model] = response.json()["results"][0]["text"]
    openai_text = complete(lora_server.url, "sql", prompt, min_tokens=0).json()["choices"][0]["text"]
    assert texts["sql"] == openai_text != texts[None]
    missing = httpx.post(f"{lora_server.url}/api/v1/generate", json={"prompt": prompt, "model": "nope"}, headers=AUTH)
    assert missing.status_code == 404
    assert "'nope' is not served here" in missing.json()["detail"]["msg"]


def load(url: str, body: object, headers: dict[str, str] | None = AUTH, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=60, **kwargs)


def wait_until_unlisted(url: str, name: str, timeout: float = 30.0) -> None:
    """Wait until ``GET /v1/models`` no longer lists adapter ``name``."""
    deadline = time.monotonic() + timeout
    while name in [c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]:
        assert time.monotonic() < deadline, f"{name!r} was still listed after {timeout:.0f}s"
        time.sleep(0.05)


def unload(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json=body, headers=AUTH, timeout=60)


def test_runtime_load_and_unload(lora_server: ServerProcess, expected: dict[str, str]) -> None:
    url = lora_server.url
    loaded = load(url, {"lora_name": "chat", "lora_path": "chat"})
    assert loaded.status_code == 200, loaded.text
    assert "'chat' added" in loaded.text
    assert [c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]] == ["tiny", "sql", "chat"]
    assert complete(url, "chat").json()["choices"][0]["text"] == expected["chat"]
    assert complete(url, "sql").json()["choices"][0]["text"] == expected["sql"]
    assert load(url, {"lora_name": "chat", "lora_path": "chat"}).status_code == 400  # the name is taken

    removed = unload(url, {"lora_name": "chat"})
    assert removed.status_code == 200, removed.text
    gone = complete(url, "chat")
    assert gone.status_code == 404
    assert gone.json()["error"]["type"] == "not_found_error"
    again = unload(url, {"lora_name": "chat"})
    assert again.status_code == 404
    assert "no LoRA adapter named 'chat'" in again.json()["error"]["message"]
    # loaded again under the same name: a new id, the same output
    assert load(url, {"lora_name": "chat", "lora_path": "chat"}).status_code == 200
    assert complete(url, "chat").json()["choices"][0]["text"] == expected["chat"]
    assert unload(url, {"lora_name": "chat"}).status_code == 200


def test_unloading_an_adapter_in_use_waits_for_its_requests(lora_server: ServerProcess) -> None:
    """The unload answers once the request running through the adapter has finished, whole;
    meanwhile the adapter takes no new requests."""
    url = lora_server.url
    assert load(url, {"lora_name": "busy", "lora_path": "chat"}).status_code == 200
    num_tokens = 480  # as long as the context allows (512): the request must outlast the checks below
    body = {"model": "busy", "prompt": PROMPT_IDS, "max_tokens": num_tokens, "min_tokens": num_tokens, "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as stream:
        lines = stream.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))  # running now
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(unload, url, {"lora_name": "busy"})
            wait_until_unlisted(url, "busy")  # the engine has taken the unload: it drains the adapter now
            refused = complete(url, "busy")
            assert not unloading.done(), "the unload answered while a request still ran through the adapter"
            events += [line for line in lines if line.startswith("data: ")]
            removed = unloading.result(timeout=60)
    assert refused.status_code == 404, refused.text
    assert removed.status_code == 200, removed.text
    chunks = [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "data: [DONE]"
    assert "busy" not in [c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]


def test_every_attack_on_the_load_route_is_a_clear_4xx(lora_server: ServerProcess, lora_files: dict[str, Path], expected: dict[str, str]) -> None:
    url = lora_server.url
    assert load(url, {"lora_name": "x", "lora_path": "chat"}, headers={}).status_code == 401
    assert load(url, {"lora_name": "x", "lora_path": "chat"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    cases: list[tuple[object, int, str]] = [
        ({"lora_name": "x", "lora_path": str(lora_files["sql"])}, 400, "is outside --lora-root"),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "is outside --lora-root"),
        ({"lora_name": "x", "lora_path": "../sql"}, 400, "contains '..'"),
        ({"lora_name": "x", "lora_path": "chat/../../sql"}, 400, "contains '..'"),
        ({"lora_name": "x", "lora_path": "escape"}, 400, "leads out of --lora-root"),
        ({"lora_name": "x", "lora_path": "leaky"}, 400, "is a symlink that leads out of --lora-root"),
        ({"lora_name": "x", "lora_path": "pickled"}, 400, "adapter_model.bin, a pickle"),
        ({"lora_name": "x", "lora_path": "garbage"}, 400, "adapter_config.json is not valid JSON"),
        ({"lora_name": "x", "lora_path": "wide"}, 400, "r=16 is above max_lora_rank=8"),
        ({"lora_name": "x", "lora_path": "nowhere"}, 400, "does not exist"),
        ({"lora_name": "x", "lora_path": "chat\x00"}, 400, "control characters"),
        ({"lora_name": "a\nb", "lora_path": "chat"}, 400, "is not allowed"),
        ({"lora_name": "x" * 10_000, "lora_path": "chat"}, 400, "is not allowed"),
        ({"lora_name": "tiny", "lora_path": "chat"}, 400, "the served model's name"),
        ({"lora_name": "sql", "lora_path": "chat"}, 400, "already loaded"),
        ({"lora_name": 5, "lora_path": "chat"}, 400, "lora_name: Input should be a valid string"),
        ({"lora_name": "x", "lora_path": ["chat"]}, 400, "lora_path: Input should be a valid string"),
        ({"lora_name": "x"}, 400, "lora_path: Field required"),
        ({"lora_name": "x", "lora_path": "chat", "trust_remote_code": True}, 400, "trust_remote_code: Extra inputs are not permitted"),
        ({"lora_name": "x", "lora_path": "chat", "load_inplace": True}, 400, "load_inplace"),
        (["chat"], 400, "the request body must be a JSON object"),
    ]
    for body, status, message in cases:
        response = load(url, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert message in error["message"], (body, error)
        assert str(lora_files["root"]) not in error["message"], "an error shows where the adapters are kept"
    huge = load(url, None, content=b'{"lora_name": "x", "lora_path": "' + b"a" * (9 * 1024 * 1024) + b'"}')
    assert huge.status_code == 413
    not_json = httpx.post(f"{url}/v1/load_lora_adapter", content=b"\x80\x81", headers=AUTH)
    assert not_json.status_code == 400
    assert unload(url, {"lora_name": 3}).status_code == 400
    assert unload(url, {"lora_name": "x\x00"}).status_code == 404
    # still serving, and nothing was loaded
    assert [c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]] == ["tiny", "sql"]
    assert complete(url, "sql").json()["choices"][0]["text"] == expected["sql"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_without_runtime_updating_the_routes_do_not_exist(server: ServerProcess) -> None:
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        response = httpx.post(f"{server.url}/v1/{route}", json={"lora_name": "x", "lora_path": "x"})
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"
        assert "no such route" in response.json()["error"]["message"]
