"""``sonar``: one command, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

SUBCOMMANDS = ["serve", "chat", "generate", "bench", "plugins"]


def build_parser() -> argparse.ArgumentParser:
    from sonar import __version__

    parser = argparse.ArgumentParser(prog="sonar", description="Sonar LLM inference engine")
    parser.add_argument("--version", action="version", version=f"sonar {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("SONAR_LOG_LEVEL", "warning"))
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"sonar.cli.{name}")
        except ImportError as exc:
            missing = subparsers.add_parser(name, help=f"(unavailable: {exc})")
            missing.set_defaults(func=lambda args, exc=exc, name=name: _unavailable(name, exc))
            continue
        module.add_parser(subparsers)
    return parser


def _unavailable(name: str, exc: Exception) -> int:
    hint = " (pip install sonar-server)" if name == "serve" else ""
    print(f"sonar {name} is not available: {exc}{hint}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        logging.getLogger("sonar").debug("command failed", exc_info=True)
        print(f"sonar {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
