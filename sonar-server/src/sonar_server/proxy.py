"""``sonar proxy``: one OpenAI endpoint in front of prefill and decode servers.

Each completions or chat request goes first to a prefill server (``sonar serve
--kv-transfer-config '{"kv_connector": "SonarConnector", "kv_role": "kv_producer"}'``) with
``max_tokens`` 1, not streamed, and ``kv_transfer_params: {"do_remote_decode": true}``; the
``kv_transfer_params`` it answers with (where its KV blocks are) go with the original request to
a decode server (``kv_role`` ``kv_consumer``), whose answer, streamed or not, is the client's.
Among the servers of each kind the one with the fewest requests in flight through this proxy
is chosen (the first listed among equals). The client's headers that matter (authorization)
are passed on; an error of either server is returned as that server sent it.
"""

from __future__ import annotations

import argparse

DEFAULT_PROXY_PORT = 8000


def add_proxy_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    help_text = "route OpenAI completions and chat through prefill and decode servers (disaggregated serving)"
    parser = subparsers.add_parser("proxy", help=help_text, description=help_text)
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers (kv_role kv_producer), e.g. http://10.0.0.1:2242")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT, help="port to listen on")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an upstream request may take")
    parser.set_defaults(func=run_proxy)
    return parser


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    for url in [*args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL (e.g. http://127.0.0.1:2242)")
    from sonar_server.proxy_app import build_proxy_app

    app = build_proxy_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
