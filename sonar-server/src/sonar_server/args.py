"""``sonar serve`` arguments: the engine's (shared with every model-loading subcommand) plus
the server's. ``docs/server-arguments.md`` is generated from this parser."""

from __future__ import annotations

import argparse
import json
import os

from sonar.cli.engine_args import add_engine_arguments
from sonar_server.lora import LoRAModule, LoRAPathError, check_adapter_folder, parse_lora_module
from sonar_server.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, CorsSettings, ServerSettings, TlsSettings


def _byte_size(text: str) -> int:
    """``8388608``, ``8MiB``, ``8M``, ``512KiB``, ``1GB``."""
    units = {"": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    if unit not in units or not number:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (examples: 8388608, 8MiB, 512KiB)")
    return int(float(number) * units[unit])


def _api_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``sonar serve`` argument to ``parser``."""
    add_engine_arguments(parser, server=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    group.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix-domain socket instead of --host/--port")
    group.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model name(s) clients send in 'model'; the first is reported (default: the model path)",
    )
    group.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require this key (repeat for several); also read from SONAR_API_KEY",
    )
    group.add_argument(
        "--api", type=_api_list, default=None, metavar="NAMES",
        help="comma-separated API surfaces to serve: openai, anthropic, kobold, ops, or a plugin's (default: all)",
    )
    group.add_argument(
        "--max-waiting-requests", type=int, default=1024,
        help="requests that may wait for a slot beyond --max-num-seqs; more get 503 with Retry-After",
    )
    group.add_argument(
        "--max-request-body-bytes", type=_byte_size, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
        help="largest request body accepted (413 above it); accepts 8MiB-style sizes",
    )
    group.add_argument(
        "--request-read-timeout", type=float, default=60.0, metavar="SECONDS",
        help="seconds a request's headers may take to arrive (from the connection, or from a later request's first byte), and its body after them; past it 408 and the connection closed",
    )
    group.add_argument(
        "--api-server-count", "-asc", type=int, default=1,
        help="HTTP server processes sharing the port, each talking to every engine core",
    )
    group.add_argument(
        "--engine-step-timeout", type=float, default=60.0,
        help="seconds one engine step may run before /health reports that engine core stuck",
    )
    group.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to let running requests finish after SIGTERM before aborting them")
    group.add_argument("--retry-after", type=int, default=1, help="seconds clients are told to wait (Retry-After) when the server is full")
    group.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let chat requests bring their own chat template (chat_template, or chat_template_kwargs.chat_template); off by default: a template is a program the server runs, and a hostile one can burn its CPU and memory",
    )
    group.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
        help="the chat template to use instead of the tokenizer's: a Jinja file, or the template itself",
    )
    group.add_argument("--disable-fastapi-docs", action="store_true", help="serve no API documentation (/docs and /openapi.json)")
    group.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under (links in /docs follow it)")
    group.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON", help='CORS: origins browsers may call from (default ["*"], as vLLM)')
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help='CORS: allowed methods (default ["*"])')
    group.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help='CORS: allowed headers (default ["*"])')
    group.add_argument("--kobold-max-length", type=int, default=100, help="KoboldAI max_length when a request leaves it out")
    group.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help="how to find tool calls in the model's text for tool_choice 'auto': hermes (the default; alias qwen), llama3_json, mistral, pythonic, or a plugin's",
    )
    group.add_argument(
        "--tool-parser-plugin", default=None, metavar="FILE",
        help="a Python file imported at start-up whose register_tool_parser('name') classes (sonar_server.parsers) --tool-call-parser can name",
    )
    group.add_argument("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM command lines: tool_choice 'auto' (the default with tools) works without it; needs --tool-call-parser")
    group.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="separate the model's reasoning from its answer (reasoning_content, Anthropic thinking): qwen3, deepseek_r1, or a plugin's",
    )
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument(
        "--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
        help='adapters loaded before the server reports ready, each served under its name in \'model\': name=path, or vLLM\'s JSON form \'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\' (repeatable)',
    )
    lora.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); needs --lora-root",
    )
    lora.add_argument(
        "--lora-root", default=None, metavar="DIR",
        help="the only folder runtime-loaded adapters may come from: lora_path is relative to it (or absolute inside it); '..' and symlinks out of it are refused",
    )
    group.add_argument(
        "--headless", action="store_true",
        help="with --nnodes and --node-rank > 0: run this host's worker ranks only (no HTTP server, no engine core), driven by the head at --master-addr",
    )
    group.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's own log level")
    group.add_argument("--access-log", action="store_true", help="also log uvicorn's line per HTTP request")
    group.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false", help="no line per HTTP request (the default; vLLM's name)")
    group.add_argument("--enable-log-requests", action="store_true", help="log each request as it arrives: its prompt, token ids and sampling parameters")
    group.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", help="log no requests (the default; vLLM's older name)")
    group.add_argument("--max-log-len", type=int, default=None, help="with --enable-log-requests: most prompt characters and token ids a line shows (default: all)")
    group.add_argument(
        "--middleware", action="append", default=[], metavar="IMPORT_PATH",
        help="an ASGI middleware class or an HTTP middleware function (async (request, call_next)) to wrap the app in, by import path (module.Name); repeatable",
    )
    group.add_argument("--response-role", default="assistant", help="the role of chat replies when the request adds a generation prompt")
    group.add_argument(
        "--return-tokens-as-token-ids", action="store_true",
        help='logprobs name tokens "token_id:N" (tokens that are not whole characters stay identifiable); a request may ask with return_tokens_as_token_ids',
    )
    tls = parser.add_argument_group("HTTPS")
    tls.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM; the chain may follow it)")
    tls.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM), where not in --ssl-certfile")
    tls.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) that client certificates must chain to")
    tls.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2), help="client certificates: 0 not asked for, 1 optional, 2 required")
    tls.add_argument(
        "--enable-ssl-refresh", action="store_true",
        help="reload the certificate, key and CA files when they change on disk (looked at every second): new connections get them, with no restart",
    )
    group.add_argument("--disable-log-stats", action="store_true", help="accepted for vLLM command lines: Sonar does not log periodic stats")


def check_server_args(args: argparse.Namespace) -> None:
    """Everything about the server's arguments that can be checked without the model: flag
    combinations, counts, parser names. Raises ValueError naming the flag."""
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not args.response_role.strip():
        raise ValueError("--response-role must not be empty")
    from sonar_server.app import import_middleware

    for path in args.middleware:
        import_middleware(path)  # importable, before the model loads
    tls = _tls(args)
    if tls is not None:
        tls.context()  # the certificate loads, before the model does
    _check_parsers(args)
    _check_lora(args)
    _check_nodes(args)


def _tls(args: argparse.Namespace) -> TlsSettings | None:
    if args.ssl_certfile is None:
        if args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs or args.enable_ssl_refresh:
            raise ValueError("--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs and --enable-ssl-refresh need --ssl-certfile")
        return None
    return TlsSettings(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.enable_ssl_refresh)


def settings_from(args: argparse.Namespace, default_model_name: str, default_sampling: dict[str, float | int] | None = None) -> ServerSettings:
    """The ``ServerSettings`` of parsed arguments (``default_sampling``: the model's
    recommended sampling, resolved with the engine's configuration)."""
    api_keys = list(args.api_key)
    if not api_keys and os.environ.get("SONAR_API_KEY"):
        api_keys = [os.environ["SONAR_API_KEY"]]
    _check_parsers(args)
    return ServerSettings(
        default_sampling=dict(default_sampling or {}),
        served_model_names=list(args.served_model_name or [default_model_name]),
        api_keys=api_keys,
        apis=args.api,
        max_n=args.max_num_seqs,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout_s=args.request_read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        retry_after_s=args.retry_after,
        kobold_default_max_length=args.kobold_max_length,
        tool_call_parser=args.tool_call_parser,
        tool_parser_plugin=os.path.abspath(args.tool_parser_plugin) if args.tool_parser_plugin else None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        lora_modules=_lora_modules(args),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_root=os.path.realpath(args.lora_root) if args.lora_root else None,
        api_server_count=args.api_server_count,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template=read_chat_template(args.chat_template),
        disable_fastapi_docs=args.disable_fastapi_docs,
        cors=CorsSettings(args.allowed_origins, args.allow_credentials, args.allowed_methods, args.allowed_headers),
        root_path=args.root_path,
        tls=_tls(args),
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        middleware=list(args.middleware),
    )


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings, like ["*"], got {text!r}')
    return value


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself where it reads as a Jinja
    template (vLLM takes both).

    :raises ValueError: neither a readable file nor a template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _check_parsers(args: argparse.Namespace) -> None:
    from sonar_server.parsers import reasoning_parsers, tool_parsers
    from sonar_server.parsers.plugin_file import load_tool_parser_plugin

    if args.tool_parser_plugin:
        load_tool_parser_plugin(args.tool_parser_plugin)  # its parsers, before their names are checked
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral, ...)")
    for flag, name, registered in (
        ("--tool-call-parser", args.tool_call_parser, tool_parsers),
        ("--reasoning-parser", args.reasoning_parser, reasoning_parsers),
    ):
        if name is not None and name not in registered():
            raise ValueError(f"{flag} {name!r} is not registered; registered: {sorted(registered())}")


def _lora_modules(args: argparse.Namespace) -> list[LoRAModule]:
    modules = [parse_lora_module(text) for text in args.lora_modules]
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules names {module.name!r} twice")
        seen.add(module.name)
    return modules


def _check_lora(args: argparse.Namespace) -> None:
    """The LoRA flags' combinations, and each startup adapter's folder (its tensors are
    checked by the engine when it loads them)."""
    enabled = getattr(args, "enable_lora", False)
    modules = _lora_modules(args)
    if modules and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora_updating:
        if not enabled:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        if not args.lora_root:
            raise ValueError("--allow-runtime-lora-updating needs --lora-root DIR: the folder runtime-loaded adapters may come from")
    if args.lora_root and not os.path.isdir(args.lora_root):
        raise ValueError(f"--lora-root {args.lora_root!r} is not a folder")
    names = set(args.served_model_name or [])
    for module in modules:
        if module.name in names:
            raise ValueError(f"--lora-modules {module.name!r} is also a --served-model-name; give the adapter another name")
        if module.base_model_name is not None and names and module.base_model_name not in names:
            raise ValueError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} is not a --served-model-name ({sorted(names)})")
        try:
            check_adapter_folder(module.path)
        except LoRAPathError as exc:
            raise ValueError(f"--lora-modules {module.name!r}: {exc}") from None


def _check_nodes(args: argparse.Namespace) -> None:
    """--headless against --nnodes / --node-rank: the head serves, every other host is headless."""
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless runs a follower host's ranks: give it --nnodes N and --node-rank 1..N-1 (node rank 0 is the head, which serves)")
    if args.node_rank > 0 and not args.headless:
        raise ValueError(f"--node-rank {args.node_rank} is a follower host: start it with --headless (only node rank 0 serves HTTP)")
