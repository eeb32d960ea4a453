"""``sonar serve [MODEL]``: the OpenAI-, Anthropic- and KoboldAI-compatible HTTP server.

The server lives in the ``sonar-server`` distribution; without it this subcommand says how to
install it.
"""

from __future__ import annotations

import argparse
import sys

_HELP = "serve a model over HTTP (OpenAI, Anthropic and KoboldAI APIs)"
_INSTALL_HINT = "sonar serve needs the sonar-server package: pip install sonar-server"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    try:
        from sonar_server.args import add_server_arguments
    except ImportError:
        parser = subparsers.add_parser("serve", help=f"{_HELP} [needs sonar-server]", add_help=False)
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        parser.set_defaults(func=run)
        return
    parser = subparsers.add_parser("serve", help=_HELP, description=_HELP)
    add_server_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from sonar_server.launcher import serve
    except ImportError as exc:
        print(f"{_INSTALL_HINT} ({exc})", file=sys.stderr)
        return 2
    return serve(args)
