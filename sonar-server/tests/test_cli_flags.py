"""``sonar serve`` takes vLLM's command lines: its flags under vLLM's names, the flags of
features not built yet refused at once by name, and every check that needs no model made
before loading, timed on the real command from process start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from pydantic import BaseModel, ConfigDict

from conftest import sonar_command
from sonar.cli.main import build_parser, parse_args
from sonar.cli.unsupported_flags import UNSUPPORTED_FLAGS
from sonar_server.sampling import build_sampling_params

# a fresh install's plugins: the first-party ones (test plugins installed by other tests
# import torch when they load, which no first-party plugin does)
FIRST_PARTY_PLUGINS = "cpu,cuda,models,server"
EARLY_FAILURE_S = 3.0


def run_sonar(*args: str, plugins: str = FIRST_PARTY_PLUGINS) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "SONAR_PLUGINS": plugins, "SONAR_PLATFORM": "cpu"}
    started = time.monotonic()
    done = subprocess.run([*sonar_command(), *args], capture_output=True, text=True, timeout=120, env=env)
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    "args, message",
    [
        (["-dcp", "2"], "--decode-context-parallel-size is not supported yet (decode context parallelism; issue 19 brings it)"),
        (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's context of 8192 tokens"),
        (["--fully-sharded-loras"], "--fully-sharded-loras is not supported yet (LoRA adapters; issue 18 brings it)"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "--tool-call-parser 'nope' is not registered"),
    ],
)
def test_bad_options_fail_within_seconds_naming_the_problem(args: list[str], message: str) -> None:
    done, elapsed = run_sonar("serve", *args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "usage:" not in done.stderr
    assert elapsed < EARLY_FAILURE_S, f"took {elapsed:.1f} s"


def test_a_taken_port_fails_within_seconds() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done, elapsed = run_sonar("serve", "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "serving on" not in done.stderr
    assert elapsed < EARLY_FAILURE_S, f"took {elapsed:.1f} s"


def test_serve_without_sonar_server_says_how_to_get_it() -> None:
    done, _ = run_sonar("serve", "--port", "2242", plugins="cpu,models")
    assert done.returncode == 2
    assert "sonar serve needs the sonar-server package: pip install sonar-server" in done.stderr


def parse(*argv: str):
    return parse_args(build_parser(), list(argv))


def test_vllm_names_and_short_forms_parse() -> None:
    args = parse("serve", "--model", "org/name", "--revision", "v1", "--download-dir", "/tmp/hub", "--trust-remote-code",
                 "-dp", "2", "-asc", "3", "-tp", "1", "--generation-config", "vllm", "--disable-log-requests")
    assert (args.model_option, args.revision, args.download_dir, args.trust_remote_code) == ("org/name", "v1", "/tmp/hub", True)
    assert (args.data_parallel_size, args.api_server_count, args.generation_config) == (2, 3, "vllm")
    from sonar.cli.engine_args import engine_args_from

    engine_args = engine_args_from(args)
    assert (engine_args.model, engine_args.revision, engine_args.trust_remote_code) == ("org/name", "v1", True)


def test_every_unsupported_flag_refuses_itself_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for entry in UNSUPPORTED_FLAGS:
        argv = ["serve", entry.flag] + (["7"] if entry.takes_value else [])
        with pytest.raises(SystemExit) as exit_info:
            parse(*argv)
        assert exit_info.value.code == 2
        assert f"{entry.flag} is not supported yet ({entry.feature}" in capsys.readouterr().err


def test_an_unknown_flag_keeps_argparse_error_and_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--max-model-lenght=5")
    err = capsys.readouterr().err
    assert "sonar serve: error: unrecognized arguments: --max-model-lenght=5 (did you mean --max-model-len?)" in err


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = None
    temperature: float | None = None


def test_model_defaults_fill_only_what_the_request_leaves_out() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50}
    body = Body()
    params = build_sampling_params(body, {"max_tokens": 1000, "temperature": None}, defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 50)
    body = Body.model_validate({"max_tokens": 500, "temperature": 0.0, "top_p": 0.5})
    params = build_sampling_params(body, {"max_tokens": 500, "temperature": 0.0}, defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.5, 500)
    assert build_sampling_params(Body(), {"max_tokens": 7}, {}).temperature == 1.0


def test_python_m_sonar_server_still_serves_the_same_parser() -> None:
    done = subprocess.run([sys.executable, "-m", "sonar_server", "-dcp", "2"], capture_output=True, text=True, timeout=120)
    assert "--decode-context-parallel-size is not supported yet" in done.stderr


def test_vllm_flags_that_change_nothing_here_are_accepted(tmp_path) -> None:
    """vLLM command lines with --swap-space, --[no-]enable-chunked-prefill, --max-seq-len-to-capture
    or an -O level parse; --enforce-eager reaches the engine (no CUDA graphs); a
    --chat-template file or inline template is read; --disable-fastapi-docs is kept."""
    from sonar.cli.engine_args import engine_args_from
    from sonar_server.args import read_chat_template

    args = parse("serve", "--swap-space", "16", "--enable-chunked-prefill", "--max-seq-len-to-capture", "8192", "-O", "3", "--enforce-eager",
                 "--disable-fastapi-docs", "--chat-template", "{{ messages[0]['content'] }}")  # fmt: skip
    assert engine_args_from(args).enforce_eager and args.disable_fastapi_docs and engine_args_from(args).enable_chunked_prefill
    assert not engine_args_from(parse("serve", "--no-enable-chunked-prefill")).enable_chunked_prefill
    assert read_chat_template(args.chat_template) == "{{ messages[0]['content'] }}"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(template)) == template.read_text()
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(SystemExit):
        parse("serve", "-O", "debug")  # an -O value other than a level still names its feature


def test_python_m_sonar_is_the_sonar_command() -> None:
    done = subprocess.run([sys.executable, "-m", "sonar", "serve", "-dcp", "2"], capture_output=True, text=True, timeout=120)
    assert "--decode-context-parallel-size is not supported yet" in done.stderr


def test_context_lengths_in_vllm_forms() -> None:
    for text, expected in (("4096", 4096), ("1k", 1000), ("1K", 1024), ("32K", 32768), ("1.5k", 1500), ("auto", None), ("-1", None)):
        assert parse("serve", "--max-model-len", text).max_model_len == expected, text
    with pytest.raises(SystemExit):
        parse("serve", "--max-model-len", "lots")


def test_cors_and_root_path_reach_the_settings() -> None:
    from sonar_server.args import settings_from

    args = parse("serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials", "--root-path", "/llm")
    settings = settings_from(args, "tiny")
    assert settings.cors.allowed_origins == ["https://a.example"] and settings.cors.allow_credentials and settings.root_path == "/llm"
    assert settings_from(parse("serve"), "tiny").cors.allowed_origins == ["*"]  # vLLM's default
    with pytest.raises(SystemExit):
        parse("serve", "--allowed-origins", "*")  # a JSON list, as vLLM takes it
