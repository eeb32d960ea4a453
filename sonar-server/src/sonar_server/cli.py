"""sonar-server's subcommands of ``sonar``, registered through ``sonar_register_cli_commands``:
``sonar serve`` (the OpenAI-, Anthropic- and KoboldAI-compatible HTTP server) and
``sonar bench serve`` (a serving benchmark client)."""

from __future__ import annotations

import argparse

_SERVE_HELP = "serve a model over HTTP (OpenAI, Anthropic and KoboldAI APIs)"
_BENCH_SERVE_HELP = "a running server (or one started here) under streaming load, vLLM's bench serve flags"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from sonar_server.args import add_server_arguments

    parser = subparsers.add_parser("serve", help=_SERVE_HELP, description=_SERVE_HELP)
    add_server_arguments(parser)
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from sonar_server.launcher import serve

    return serve(args)


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from sonar_server.bench_serve import add_bench_serve_arguments

    parser = subparsers.add_parser("serve", help=_BENCH_SERVE_HELP, description=_BENCH_SERVE_HELP)
    add_bench_serve_arguments(parser)
    parser.set_defaults(func=run_bench_serve)
    return parser


def run_bench_serve(args: argparse.Namespace) -> int:
    from sonar_server.bench_serve import run

    return run(args)
