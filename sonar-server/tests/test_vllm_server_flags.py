"""vLLM's frontend flags on a real ``sonar serve``: HTTPS (``--ssl-*``, ``--enable-ssl-refresh``), ``--response-role``,
``--return-tokens-as-token-ids`` (and the request field of the same name),
``--enable-log-requests`` with ``--max-log-len``, ``--override-generation-config``, and
``--config`` YAML files."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import KV_CACHE_BYTES, ServerProcess
from sonar.cli.main import build_parser, parse_args
from test_cli_flags import EARLY_FAILURE_S, run_sonar

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")


def make_certificate(folder: Path, organization: str = "Sonar") -> tuple[str, str]:
    """A new self-signed certificate for 127.0.0.1 and its key (PEM files in ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/O={organization}/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def https_server(tiny_model: str, certificate: tuple[str, str]) -> Iterator[ServerProcess]:
    cert, key = certificate
    process = ServerProcess(
        [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
         "--ssl-certfile", cert, "--ssl-keyfile", key, "--response-role", "narrator", "--return-tokens-as-token-ids",
         "--enable-log-requests", "--max-log-len", "7", "--override-generation-config", '{"max_new_tokens": 3}'],
        verify=cert,
    )
    yield process
    process.stop()


def client_of(server: ServerProcess, certificate: tuple[str, str]) -> openai.OpenAI:
    http = httpx.Client(verify=ssl.create_default_context(cafile=certificate[0]))
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", http_client=http, max_retries=0)


def test_https_serves_the_official_client_and_refuses_plain_http(https_server: ServerProcess, certificate: tuple[str, str]) -> None:
    assert https_server.url.startswith("https://")
    reply = client_of(https_server, certificate).completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    with pytest.raises(httpx.HTTPError):  # a plain-HTTP request to the TLS port gets no HTTP answer
        httpx.get(https_server.url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust the certificate
        httpx.get(f"{https_server.url}/health", timeout=5)
    assert "on https://127.0.0.1" in https_server.log()


def test_response_role_names_replies_to_a_generation_prompt(https_server: ServerProcess, certificate: tuple[str, str]) -> None:
    client = client_of(https_server, certificate)
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert reply.choices[0].message.role == "narrator"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "narrator"
    # continuing the last message: the reply has that message's role, as in vLLM
    continued = client.chat.completions.create(
        model="tiny", messages=[*messages, {"role": "assistant", "content": "well"}], max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert continued.choices[0].message.role == "assistant"


def test_tokens_as_token_ids(https_server: ServerProcess, certificate: tuple[str, str], tiny_model: str) -> None:
    from transformers import AutoTokenizer

    client = client_of(https_server, certificate)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reply = client.completions.create(model="tiny", prompt="one two three", max_tokens=6, temperature=0, logprobs=2)
    tokens = reply.choices[0].logprobs.tokens
    assert all(token.startswith("token_id:") for token in tokens)
    ids = [int(token.split(":", 1)[1]) for token in tokens]
    assert tokenizer.decode(ids) == reply.choices[0].text
    for chosen, top in zip(tokens, reply.choices[0].logprobs.top_logprobs):
        assert all(name.startswith("token_id:") for name in top) and len(top) >= 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content][0].startswith("token_id:")
    assert all(alt.token.startswith("token_id:") for entry in content for alt in entry.top_logprobs)
    assert tokenizer.decode([int(entry.token.split(":")[1]) for entry in content]) == chat.choices[0].message.content
    # a request may ask for decoded tokens instead
    plain = client.completions.create(model="tiny", prompt="one two three", max_tokens=6, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": False})
    assert "".join(plain.choices[0].logprobs.tokens) == plain.choices[0].text
    assert not any(token.startswith("token_id:") for token in plain.choices[0].logprobs.tokens)


def test_requests_are_logged_cut_to_max_log_len(https_server: ServerProcess, certificate: tuple[str, str]) -> None:
    client_of(https_server, certificate).completions.create(model="tiny", prompt="abcdefghijklmnop", max_tokens=2)
    lines = [line for line in https_server.log().splitlines() if "received request cmpl-" in line and "'abcdefg'" in line]
    assert lines, https_server.log()[-2000:]
    assert "abcdefgh" not in lines[-1]
    assert "max_tokens=2" in lines[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ssl-certfile", "/nonexistent/cert.pem"], "do not load as a certificate"),
        (["--ssl-keyfile", "/tmp/key.pem"], "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs and --enable-ssl-refresh need --ssl-certfile"),
        (["--enable-ssl-refresh"], "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs and --enable-ssl-refresh need --ssl-certfile"),
        (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
    ],
)
def test_bad_tls_and_log_flags_fail_before_loading(flags: list[str], message: str) -> None:
    done, elapsed = run_sonar("serve", *flags)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert elapsed < EARLY_FAILURE_S


def test_client_certificates_need_ca_certs(certificate: tuple[str, str]) -> None:
    cert, key = certificate
    done, _ = run_sonar("serve", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2")
    assert done.returncode != 0 and "need --ssl-ca-certs" in done.stderr


def served_certificate(server: ServerProcess) -> bytes:
    """The certificate a new connection to ``server`` is shown (DER)."""
    return ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", server.port), timeout=10))


def der(cert: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(cert).read_text())


def replace_file(source: str, target: Path) -> None:
    """``target`` replaced by a copy of ``source`` in one rename, as certificate tools write."""
    shutil.copyfile(source, f"{target}.new")
    os.replace(f"{target}.new", target)


def test_ssl_refresh_shows_new_connections_the_replaced_certificate(tiny_model: str, tmp_path: Path) -> None:
    """--enable-ssl-refresh: replacing the certificate and key files changes the certificate of
    new connections, with no restart; a key that does not match the certificate (the moment
    between the two files' replacement) leaves the server on its current one."""
    old_cert, old_key = make_certificate(tmp_path / "old", "Sonar old")
    new_cert, new_key = make_certificate(tmp_path / "new", "Sonar new")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    replace_file(old_cert, cert)
    replace_file(old_key, key)
    server = ServerProcess(
        [tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "512",
         "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--enable-ssl-refresh"],
        verify=old_cert,
    )  # fmt: skip
    try:
        assert served_certificate(server) == der(old_cert)
        replace_file(new_key, key)  # the key first: it does not match the certificate still there
        deadline = time.monotonic() + 20
        while "do not load together" not in server.log():
            assert time.monotonic() < deadline, server.log()[-2000:]
            time.sleep(0.2)
        assert served_certificate(server) == der(old_cert)  # the old pair still serves
        assert httpx.get(f"{server.url}/health", verify=ssl.create_default_context(cafile=old_cert), timeout=10).status_code == 200

        replace_file(new_cert, cert)
        while served_certificate(server) != der(new_cert):
            assert time.monotonic() < deadline + 20, server.log()[-2000:]
            time.sleep(0.2)
        trusting_new = ssl.create_default_context(cafile=new_cert)
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, verify=trusting_new, timeout=30).status_code == 200
        with pytest.raises(httpx.ConnectError):  # a client that trusts only the old certificate no longer connects
            httpx.get(f"{server.url}/health", verify=ssl.create_default_context(cafile=old_cert), timeout=10)
        assert "loaded the changed certificate files" in server.log()
    finally:
        server.stop()


def test_override_generation_config_sets_the_default_length(https_server: ServerProcess, certificate: tuple[str, str]) -> None:
    client = client_of(https_server, certificate)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    longer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 5


# --config


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_flags_and_the_command_line_winning(tmp_path: Path) -> None:
    config = write(tmp_path, "model: /models/from-file\nmax-num-seqs: 7\nmax_model_len: 4k\nenable-prefix-caching: false\n"
                             "port: 9999\nserved-model-name: [a, b]\nreturn-tokens-as-token-ids: true\nallowed-origins: '[\"x\"]'\n")
    args = parse_args(build_parser(), ["serve", "--config", config])
    assert (args.model_option, args.max_num_seqs, args.max_model_len, args.enable_prefix_caching) == ("/models/from-file", 7, 4000, False)
    assert (args.port, args.served_model_name, args.return_tokens_as_token_ids, args.allowed_origins) == (9999, ["a", "b"], True, ["x"])
    # the command line wins, wherever it puts its flags and its model
    for argv in (["serve", "m", "--config", config, "--max-num-seqs", "3"], ["serve", "--max-num-seqs=3", f"--config={config}", "--port", "1", "m"]):
        args = parse_args(build_parser(), argv)
        assert (args.model, args.model_option, args.max_num_seqs, args.served_model_name) == ("m", None, 3, ["a", "b"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("- a list\n", "must hold a mapping of flag names to values"),
        ("max-num-seqs: [1\n", "is not valid YAML"),
        ("max-num-sqs: 4\n", "the --config file names 'max-num-sqs', which is not a flag of this command (did you mean max-num-seqs?)"),
        ("max-model-len: 100000\n", "--max-model-len 100000 exceeds the model's context of 8192 tokens"),
    ],
)
def test_bad_config_files_fail_at_once_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    done, elapsed = run_sonar("serve", "--config", write(tmp_path, text))
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert elapsed < EARLY_FAILURE_S


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    done, _ = run_sonar("serve", "--config", str(tmp_path / "absent.yaml"))
    assert done.returncode != 0 and "absent.yaml' cannot be read" in done.stderr


def test_a_request_cannot_change_how_the_server_reads_outputs(https_server: ServerProcess, certificate: tuple[str, str]) -> None:
    client = client_of(https_server, certificate)
    whole = client.completions.create(model="tiny", prompt="one two", max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    for kind in ("delta", "final_only"):
        # streamed, not sent whole at the end: the text comes in several pieces. A loaded host
        # may find several outputs waiting and send them as one piece, so one of three streams
        # must show it; a server that took the request's output_kind never would.
        counts = []
        for _ in range(3):
            chunks = client.completions.create(model="tiny", prompt="one two", max_tokens=64, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "output_kind": kind})
            pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices and chunk.choices[0].text]
            assert "".join(pieces) == whole.choices[0].text
            counts.append(len(pieces))
            if counts[-1] > 1:
                break
        assert max(counts) > 1, (kind, counts)


# --uds


def test_serving_on_a_unix_socket(tiny_model: str, tmp_path: Path) -> None:
    import os
    import signal
    import socket as socketlib
    import time

    from conftest import sonar_command

    path = str(tmp_path / "sonar.sock")
    with socketlib.socket(socketlib.AF_UNIX) as stale:  # a file left by a server that is gone
        stale.bind(path)
    command = [*sonar_command(), "serve", tiny_model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_CACHE_BYTES,
               "--max-model-len", "512", "--uds", path, "--api-server-count", "2"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://sonar")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        client = openai.OpenAI(base_url="http://sonar/v1", api_key="none", http_client=http, max_retries=0)
        for _ in range(4):  # both API servers answer on the one socket
            assert client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}).usage.completion_tokens == 3
        done, _ = run_sonar("serve", "--uds", path)  # taken: refused at once
        assert done.returncode != 0 and "another server answers there" in done.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert not os.path.exists(path)  # removed on the way out
    assert "over the Unix socket" in log.read_text()


def test_a_uds_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a socket")
    done, elapsed = run_sonar("serve", "--uds", str(path))
    assert done.returncode != 0 and "exists and is not a socket" in done.stderr and elapsed < EARLY_FAILURE_S


# --middleware

MIDDLEWARE = """
class Tag:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-acme", b"class"))
            await send(message)

        await self.app(scope, receive, tagged)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-acme-function"] = request.url.path
    return response
"""


def test_middleware_classes_and_functions_wrap_the_app(tiny_model: str, tmp_path: Path) -> None:
    (tmp_path / "acme_middleware.py").write_text(MIDDLEWARE)
    env = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    server = ServerProcess([tiny_model, "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--max-model-len", "256",
                            "--middleware", "acme_middleware.Tag", "--middleware", "acme_middleware:stamp"], env=env)
    try:
        models = httpx.get(f"{server.url}/v1/models")
        assert models.status_code == 200 and models.headers["x-acme"] == "class" and models.headers["x-acme-function"] == "/v1/models"
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as stream:
            assert stream.headers["x-acme"] == "class" and stream.headers["x-acme-function"] == "/v1/completions"
            assert b"[DONE]" in b"".join(stream.iter_bytes())
    finally:
        server.stop()
    done, elapsed = run_sonar("serve", "--middleware", "acme_missing.Tag")
    assert done.returncode != 0 and "--middleware 'acme_missing.Tag' cannot be imported" in done.stderr and elapsed < EARLY_FAILURE_S
