"""``--tool-parser-plugin FILE``: a Python file imported at start-up (in every API server
process) whose ``register_tool_parser`` decorators add tool-call parsers."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from types import ModuleType

_loaded: dict[str, ModuleType] = {}  # real path -> the module, imported once per process


def load_tool_parser_plugin(path: str) -> ModuleType:
    """Import the plugin file at ``path`` (once per process; later calls return the module).

    :raises ValueError: the file does not exist, is not a Python file, or fails to import (the
        message names the file, the line and the error)."""
    real = os.path.realpath(path)
    if real in _loaded:
        return _loaded[real]
    if not os.path.isfile(real):
        raise ValueError(f"--tool-parser-plugin {path!r}: no such file")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0])
    module_name = f"sonar_tool_parser_plugin_{stem}"  # its own name: a file called json.py must not replace json
    spec = importlib.util.spec_from_file_location(module_name, real)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path!r} is not a Python file (name it *.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look classes' modules up there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"--tool-parser-plugin {path!r} failed to import{_where(exc, real)}: {type(exc).__name__}: {exc}") from exc
    _loaded[real] = module
    return module


def _where(exc: Exception, real: str) -> str:
    """`` (line N)``: the plugin's own line the error came from, where it did."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f" (line {exc.lineno})"
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == real]
    return f" (line {lines[-1]})" if lines else ""
