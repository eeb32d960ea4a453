"""``sonar``: one command; its subcommands come from plugins through
``sonar_register_cli_commands`` (sonar-core's own included), so the core imports no server code."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# commands other distributions provide, and how to get them where they are missing
PROVIDED_ELSEWHERE = {"serve": "sonar-server", "bench serve": "sonar-server", "proxy": "sonar-server"}


def _commands() -> list[tuple[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]]]:
    from sonar.plugins import collect
    from sonar.registry import import_class

    commands = []
    for name, add_parser, *_ in collect("sonar_register_cli_commands"):
        commands.append((name, import_class(add_parser) if isinstance(add_parser, str) else add_parser))
    return sorted(commands, key=lambda command: len(command[0].split()))  # parents before their subcommands


def _subparsers_of(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _add_missing(subparsers: argparse._SubParsersAction, name: str, distribution: str) -> None:
    hint = f"sonar {name} needs the {distribution} package: pip install {distribution}"
    parser = subparsers.add_parser(name.split()[-1], help=f"[needs {distribution}]", add_help=False)
    parser.set_defaults(func=lambda args: _unavailable(hint), _unavailable=True)  # whatever follows is ignored


def _unavailable(hint: str) -> int:
    print(hint, file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``sonar`` parser with every registered subcommand."""
    from sonar import __version__

    parser = argparse.ArgumentParser(prog="sonar", description="Sonar LLM inference engine")
    parser.add_argument("--version", action="version", version=f"sonar {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("SONAR_LOG_LEVEL", "warning"))
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, add_parser in _commands():
        *parent, leaf = name.split()
        subparsers = top if not parent else _subparsers_of(parsers.get(" ".join(parent), parser))
        if subparsers is None or (not parent and name in parsers):
            continue
        try:
            added = add_parser(subparsers)
        except ImportError as exc:  # a plugin whose command needs a package that is missing
            logging.getLogger("sonar").warning("sonar %s is unavailable: %s", name, exc)
            continue
        added.set_defaults(_command_parser=added)
        parsers[name] = added
    for name, distribution in PROVIDED_ELSEWHERE.items():
        *parent, _ = name.split()
        holder = parsers.get(" ".join(parent)) if parent else parser
        subparsers = _subparsers_of(holder) if holder is not None else None
        if name not in parsers and subparsers is not None:
            _add_missing(subparsers, name, distribution)
    return parser


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings if option.startswith("--")]


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's ``unrecognized arguments`` message, with the closest known flag named."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    flags = [extra.split("=", 1)[0] for extra in extras if extra.startswith("-")]
    if flags:
        close = difflib.get_close_matches(flags[0], _option_strings(parser), n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]}?)"
    return message


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    from sonar.cli.config_file import expand_config_file

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config_file(parser, argv)
    except ValueError as exc:
        parser.error(str(exc))
    args, extras = parser.parse_known_args(argv)
    if extras and not getattr(args, "_unavailable", False):
        command_parser: Any = getattr(args, "_command_parser", None) or parser
        command_parser.error(unrecognized_message(command_parser, extras))
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
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
