"""Server settings (the HTTP side; the engine's are ``sonar.config.EngineArgs``)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from sonar_server.lora import LoRAModule

DEFAULT_PORT = 2242
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(slots=True)
class CorsSettings:
    """Cross-origin requests from browsers, as vLLM allows them by default (any origin,
    method and header; no credentials)."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])


@dataclass(slots=True)
class TlsSettings:
    """HTTPS: the server's certificate and key, and optionally the CAs that client
    certificates must chain to (``cert_reqs``: ``ssl.CERT_NONE`` 0, ``CERT_OPTIONAL`` 1,
    ``CERT_REQUIRED`` 2); ``refresh``: reload the files when they change (``tls_refresh``)."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0
    refresh: bool = False

    def __post_init__(self) -> None:
        if self.cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl cert_reqs must be 0 (none), 1 (optional) or 2 (required), got {self.cert_reqs}")
        if self.cert_reqs and not self.ca_certs:
            raise ValueError("client certificates (--ssl-cert-reqs 1 or 2) need --ssl-ca-certs: the CAs they must chain to")

    def context(self) -> ssl.SSLContext:
        """A server context with the certificate loaded (raises ValueError naming the file
        that does not load)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-certfile {self.certfile!r} / --ssl-keyfile {self.keyfile!r} do not load as a certificate and its key: {exc}") from None
        if self.ca_certs:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--ssl-ca-certs {self.ca_certs!r} does not load: {exc}") from None
        context.verify_mode = ssl.VerifyMode(self.cert_reqs)
        return context


@dataclass(slots=True)
class ServerSettings:
    """What ``sonar serve`` was told about HTTP, limits and the API surfaces."""

    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    apis: list[str] | None = None  # None: every registered surface
    max_n: int = 256
    max_waiting_requests: int = 1024
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_read_timeout_s: float = 60.0  # --request-read-timeout: a request's headers, then its body, must each arrive within this long
    shutdown_timeout: float = 30.0
    retry_after_s: int = 1
    kobold_default_max_length: int = 100
    tool_call_parser: str | None = None  # --tool-call-parser: a registered tool-call parser
    tool_parser_plugin: str | None = None  # --tool-parser-plugin: a file registering tool-call parsers, imported by every API server
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser: a registered reasoning parser
    default_sampling: dict[str, float | int] = field(default_factory=dict)  # the model's recommended sampling (--generation-config)
    lora_modules: list[LoRAModule] = field(default_factory=list)  # --lora-modules: loaded before serving
    allow_runtime_lora_updating: bool = False  # --allow-runtime-lora-updating
    lora_root: str | None = None  # --lora-root, as a real path
    api_server_count: int = 1  # API servers sharing the engine cores (runtime adapter ids are spread over them)
    trust_request_chat_template: bool = False  # --trust-request-chat-template: requests may bring their own chat template
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    disable_fastapi_docs: bool = False  # --disable-fastapi-docs: no /docs, no /openapi.json
    cors: CorsSettings = field(default_factory=lambda: CorsSettings())  # --allowed-origins and its siblings
    root_path: str = ""  # --root-path: the prefix a proxy serves the server under
    tls: TlsSettings | None = None  # --ssl-certfile and its siblings: serve HTTPS
    response_role: str = "assistant"  # --response-role: the role of chat replies to a generation prompt
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"
    enable_log_requests: bool = False  # --enable-log-requests: log each request as it arrives
    max_log_len: int | None = None  # --max-log-len: most prompt characters and token ids a log line shows
    middleware: list[str] = field(default_factory=list)  # --middleware: import paths of ASGI middleware, outermost last

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be at least 1024, got {self.max_request_body_bytes}")
        if not self.request_read_timeout_s > 0:
            raise ValueError(f"request_read_timeout_s must be positive, got {self.request_read_timeout_s}")
        if self.allow_runtime_lora_updating and not self.lora_root:
            raise ValueError("allow_runtime_lora_updating needs lora_root")
        for module in self.lora_modules:
            if module.name in self.served_model_names:
                raise ValueError(f"LoRA adapter {module.name!r} has the name of the served model; give it another name")
            if module.base_model_name is not None and module.base_model_name not in self.served_model_names:
                raise ValueError(f"LoRA adapter {module.name!r}: base_model_name {module.base_model_name!r} is not a served model name ({self.served_model_names})")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
