"""``--config FILE``: a YAML file of flags, as vLLM takes it.

Each key is a flag's name without its dashes (``max-num-seqs`` or ``max_num_seqs``), each value
its argument. ``true`` gives a switch, ``false`` its ``--no-`` form (or leaves a plain switch
off), a list gives one argument per item, a mapping gives its JSON. Flags on the command line
win over the file's: the file's are placed before them.
"""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any

CONFIG_FLAG = "--config"


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the flags of its ``--config`` file inserted right after the command (and
    its positional model, where given), so that the command line's own flags override them.

    :raises ValueError: the file is unreadable, not a YAML mapping, or given twice."""
    positions = [i for i, token in enumerate(argv) if token == CONFIG_FLAG or token.startswith(CONFIG_FLAG + "=")]
    if not positions:
        return argv
    if len(positions) > 1:
        raise ValueError("--config is given more than once; give one file")
    index = positions[0]
    if argv[index] == CONFIG_FLAG:
        if index + 1 >= len(argv):
            raise ValueError("--config needs a YAML file")
        path = argv[index + 1]
    else:
        path = argv[index].split("=", 1)[1]
    command_parser, insert_at = _command_of(parser, argv)
    if command_parser is None or not _has_option(command_parser, CONFIG_FLAG):
        return argv  # the command does not take --config: its parser reports the flag
    settings = read_config_file(path)
    skip_model = _names_model(command_parser, argv[insert_at:])
    if insert_at < len(argv) and not argv[insert_at].startswith("-"):
        insert_at += 1  # after the positional model, so that a list value cannot swallow it
    flags = config_flags(command_parser, settings, skip_model=skip_model)
    return argv[:insert_at] + flags + argv[insert_at:]


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping a ``--config`` file holds."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            settings = yaml.safe_load(handle)
    except OSError as exc:
        raise ValueError(f"--config {path!r} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path!r} is not valid YAML: {exc}") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict) or not all(isinstance(key, str) for key in settings):
        raise ValueError(f"--config {path!r} must hold a mapping of flag names to values (max-num-seqs: 64), not {type(settings).__name__}")
    return settings


def config_flags(parser: argparse.ArgumentParser, settings: dict[str, Any], skip_model: bool = False) -> list[str]:
    """Command-line tokens for ``settings`` (flag name -> value) against ``parser``'s options."""
    tokens: list[str] = []
    for key, value in settings.items():
        name = key.strip().lstrip("-").replace("_", "-")
        if name == "config":
            raise ValueError("a --config file cannot name another --config file")
        if name == "model" and skip_model:
            continue  # the command line names the model
        flag = f"--{name}"
        if not _has_option(parser, flag):
            close = difflib.get_close_matches(flag, [o for o in parser._option_string_actions if o.startswith("--")], n=1, cutoff=0.6)
            raise ValueError(f"the --config file names {key!r}, which is not a flag of this command" + (f" (did you mean {close[0][2:]}?)" if close else ""))
        if value is None:
            continue
        if isinstance(value, bool):
            tokens += _switch(parser, flag, value)
        elif isinstance(value, list):
            tokens += [flag, *(_text(item) for item in value)]
        else:
            tokens += [flag, _text(value)]
    return tokens


def _switch(parser: argparse.ArgumentParser, flag: str, on: bool) -> list[str]:
    action = _action_of(parser, flag)
    negative = "--no-" + flag[2:]
    takes_value = action is not None and action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)
    if takes_value:  # a flag whose value is a boolean word (vLLM's --trust-remote-code true style)
        return [flag, "true" if on else "false"]
    if on:
        return [flag]
    return [negative] if _has_option(parser, negative) else []


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _has_option(parser: argparse.ArgumentParser, flag: str) -> bool:
    return _action_of(parser, flag) is not None


def _action_of(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return parser._option_string_actions.get(flag)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _command_of(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser | None, int]:
    """The (sub)command parser ``argv`` selects, and the index just past its name."""
    current, index, chosen = parser, 0, None
    while index < len(argv) and _subparsers(current) is not None:
        token = argv[index]
        if token.startswith("-"):  # an option of a parent command, before the subcommand
            action = _action_of(current, token.split("=", 1)[0])
            takes_value = action is not None and action.nargs != 0 and "=" not in token
            index += 2 if takes_value else 1
            continue
        choices = _subparsers(current).choices
        if token not in choices:
            break
        current = chosen = choices[token]
        index += 1
    return chosen, index


def _names_model(command_parser: argparse.ArgumentParser, command_argv: list[str]) -> bool:
    """Whether the command line itself names the model (positionally or with --model)."""
    if "--model" in command_argv or any(token.startswith("--model=") for token in command_argv):
        return True
    if not any(action.dest == "model" and not action.option_strings for action in command_parser._actions):
        return False
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("model", nargs="?")
    for number, action in enumerate(command_parser._actions):  # the command's options, so their values are not taken for the model
        if not action.option_strings:
            continue
        if action.nargs == 0:
            probe.add_argument(*action.option_strings, dest=f"option_{number}", action="store_const", const=True)
        else:
            probe.add_argument(*action.option_strings, dest=f"option_{number}", nargs=action.nargs)
    try:
        known, _ = probe.parse_known_args(command_argv)
    except SystemExit:
        return False
    return known.model is not None
