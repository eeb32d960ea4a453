"""Test support: ``sonar serve`` forked from a process that has imported its heavy dependencies.

A test suite that starts dozens of servers pays, in every one, the imports of torch,
transformers' configuration and tokenizer code and the HTTP stack: about 6 s of CPU on a
2-core host, most of a tiny model's start. This module is a fork-server table
(``sonar.engine.fork_server``): a server started with it imports them once, and each
``sonar serve`` forked from it runs the command's own ``main`` as the console script would,
in its own process, with the environment, working directory and output streams it is given.

Only third-party modules are preloaded: none of them reads Sonar's settings from the
environment, and ``prometheus_client`` (which chooses its multiprocess mode when it is
imported) is left to each server. A caller whose environment differs from the fork server's
starts a fresh interpreter instead (Sonar's own ``SONAR_*`` settings aside, which Sonar reads
after the fork): what an import read from the environment stays read.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading

from sonar.engine.fork_server import ForkServer, ForkServerError, ForkServerProcess

ENTRY_POINTS = {"serve": "sonar_server.testing:serve_main"}
PRELOAD = (
    "torch",
    "transformers:AutoConfig",
    "transformers:AutoTokenizer",
    "transformers.utils.type_validators",  # what a model's configuration class imports (torch.distributed's tensors)
    "transformers.tokenization_utils_tokenizers",
    "fastapi",
    "uvicorn",
    "httpx",
    "msgspec",
    "zmq",
    "jinja2",
)
#: variables that change while a test session runs and that no import reads
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
#: Sonar's own settings: read when Sonar's code runs, after the fork (nothing of Sonar's beyond
#: the fork server itself is imported before it)
_SONAR_ENV_PREFIX = "SONAR_"


def serve_main(args: list[str], fds: list[int]) -> None:
    """The fork server's child: ``sonar <args>`` (``args[0]`` is ``serve``), ending as an
    interpreter does: non-daemon threads joined (with what modules asked to run before that,
    such as an executor's shutdown), then the exit handlers (those the preloaded modules
    registered on import included, as a fresh interpreter importing them would have), then
    its output flushed."""
    from sonar.cli.main import main
    from sonar.engine.process_util import exit_with_parent

    exit_with_parent(watchdog=False)  # a server outlives no test session
    sys.argv = [shutil.which("sonar") or "sonar", *args]
    code = 1
    try:
        code = main(args)
    finally:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    raise SystemExit(code)


class ServeForks:
    """Starts ``sonar serve`` processes from one fork server (started at construction, so its
    imports overlap the caller's work)."""

    def __init__(self) -> None:
        self._env = self._comparable(os.environ)
        self._server = ForkServer("sonar_server.testing")

    @staticmethod
    def _comparable(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in env.items() if key not in _VOLATILE_ENV and not key.startswith(_SONAR_ENV_PREFIX)}

    def start(self, args: list[str], env: dict[str, str], log_fd: int) -> ForkServerProcess | None:
        """``sonar <args>`` with ``env``, its output to ``log_fd``; None where it must start
        as a fresh interpreter (another environment than the server's, or no server)."""
        if self._comparable(env) != self._env:
            return None
        try:
            return self._server.start("serve", args, [], env, timeout=300.0, stdio=(log_fd, log_fd))
        except ForkServerError:
            return None
