"""Worker ranks forked from a process that has imported torch and Sonar once.

A rank started as a fresh interpreter spends seconds of CPU importing torch, transformers and
the model code before it does anything; a parallel engine starts one per rank, every time an
engine is built. A fork server is that import done once: one helper process per launching
process (started on first use), which forks a rank on request. Its children start with every
module loaded.

The launcher talks to it over a Unix socket pair: a request is JSON naming an entry point of
``ENTRY_POINTS`` (never code), its arguments, the environment and working directory the child
gets, and the descriptors it inherits (its socket to the executor, and the launcher's own
stdout and stderr at that moment) passed as ancillary data; the answer is the child's pid, and
each child's exit status is reported when the server reaps it. The server forks only while it
runs a single thread (``single_threaded``); otherwise it answers with an error and the launcher
starts a fresh interpreter instead. It exits when the launcher's end of the socket closes, and
its children exit with it (each rank dies with its parent).

What a server can run and what it imports first come from a *table*: a module with
``ENTRY_POINTS`` and ``PRELOAD`` as this one has, named by the launcher when it starts the
server (this module's own table by default: worker ranks).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from sonar.engine.process_util import ChildSignals

logger = logging.getLogger(__name__)

#: What a fork server can run: an entry point's name -> ``module:function``; the function
#: takes the request's arguments (strings) and the child's inherited descriptors, and exits
#: the process itself.
ENTRY_POINTS = {"tp-rank": "sonar.executor.multiproc:rank_process_main"}
#: What a fork server imports before it forks anything: what a rank imports first, as
#: ``module`` or ``module:attribute`` (transformers loads its configuration classes lazily, on
#: first access: 1.8 s of a rank's start otherwise).
PRELOAD = ("torch", "sonar.executor.multiproc", "sonar.worker.model_runner", "sonar_models", "transformers:AutoConfig")
#: this module: the table of a rank-forking server
RANKS_TABLE = "sonar.engine.fork_server"
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 8


class ForkServerError(RuntimeError):
    """The fork server cannot start a child (it is gone, or it runs threads)."""


class ForkServerProcess(ChildSignals):
    """A child of the fork server, with the part of ``subprocess.Popen`` the executor uses
    (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``);
    its exit status comes from the server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None
        self.args = f"fork-server child {pid}"

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.wait_for_exit(remaining)
        return self.returncode  # type: ignore[return-value]


class ForkServer:
    """The launching side: starts the server process, sends it requests, and keeps the exit
    codes it reports (a reader thread). One per launching process: ``ForkServer.shared()``."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> ForkServer:
        """This process's fork server, started on first use (again if the last one died)."""
        with cls._shared_lock:
            if cls._shared is None or not cls._shared.alive or cls._shared.owner != os.getpid():
                cls._shared = cls()
            return cls._shared

    def __init__(self, table: str = RANKS_TABLE) -> None:
        """Start a server whose entry points and preloaded modules are ``table``'s (a module
        name: ``ENTRY_POINTS`` and ``PRELOAD``, as this module defines them)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.owner = os.getpid()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sonar.engine.fork_server", str(theirs.fileno()), table],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._request_lock = threading.Lock()
        self._state = threading.Condition()
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._answers: list[dict[str, Any]] = []
        self.alive = True
        threading.Thread(target=self._read, name="sonar-fork-server-reader", daemon=True).start()

    def start(
        self, entry: str, args: list[str], fds: list[int], env: dict[str, str], timeout: float = 120.0, stdio: tuple[int, int] = (1, 2)
    ) -> ForkServerProcess:
        """Fork the table's ``ENTRY_POINTS[entry]`` with ``args``, inheriting ``fds`` (then
        ``stdio``, its stdout and stderr: this process's by default), in ``env`` and this
        process's working directory. Raises ``ForkServerError`` where it cannot (the caller
        then starts a fresh interpreter)."""
        request = json.dumps({"entry": entry, "args": args, "env": env, "cwd": os.getcwd()}).encode()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with self._request_lock:
            if not self.alive:
                raise ForkServerError("the fork server is gone")
            try:
                socket.send_fds(self._sock, [request], [*fds, *stdio])
            except OSError as exc:
                raise ForkServerError(f"the fork server is gone ({exc})") from None
            deadline = time.monotonic() + timeout
            with self._state:
                while not self._answers:
                    if not self.alive or time.monotonic() > deadline:
                        raise ForkServerError("the fork server did not answer")
                    self._state.wait(0.5)
                answer = self._answers.pop(0)
        if "error" in answer:
            raise ForkServerError(answer["error"])
        with self._state:
            self._children.add(answer["pid"])
        return ForkServerProcess(self, answer["pid"])

    def close(self) -> None:
        """Stop the server (its children exit with it)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the server reads the end
        except OSError:
            pass
        self._sock.close()

    def exit_code(self, pid: int) -> int | None:
        with self._state:
            if pid in self._exits:
                return self._exits[pid]
            if not self.alive:  # the server is gone: its children died with it
                return -signal.SIGKILL
            return None

    def wait_for_exit(self, timeout: float | None) -> None:
        with self._state:
            self._state.wait(0.5 if timeout is None else min(timeout, 0.5))

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(_MAX_MESSAGE)
                if not data:
                    break
                message = json.loads(data)
                with self._state:
                    if "exited" in message:
                        self._exits[message["exited"]] = message["code"]
                    else:
                        self._answers.append(message)
                    self._state.notify_all()
        except (OSError, ValueError) as exc:
            logger.warning("the fork server's socket failed: %s", exc)
        finally:
            with self._state:
                self.alive = False
                self._state.notify_all()


# -- the server process ----------------------------------------------------------------------


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork_child(sock: socket.socket, entry_point: str, request: dict[str, Any], fds: list[int]) -> int:
    """Fork ``entry_point`` (``module:function``) for ``request``; returns the child's pid
    (in the server)."""
    module_name, _, function_name = entry_point.partition(":")
    target = getattr(importlib.import_module(module_name), function_name)
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never returns into the server's loop
        sock.close()
        *inherited, stdout, stderr = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        target(list(request["args"]), inherited)
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def serve(fd: int, table_name: str = RANKS_TABLE) -> None:
    """The server's loop: fork what is asked (an entry point of ``table_name``'s table),
    report what exits, stop when the launcher's end closes."""
    from sonar.engine.process_util import exit_with_parent, set_process_title, single_threaded

    exit_with_parent(watchdog=False)  # and the launcher's end of the socket closing
    set_process_title("fork-server")
    sock = socket.socket(fileno=fd)
    table = importlib.import_module(table_name)
    entry_points: dict[str, str] = table.ENTRY_POINTS
    for name in table.PRELOAD:
        module_name, _, attribute = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            if attribute:
                getattr(module, attribute)
        except ImportError:
            pass
    try:  # children set their titles: the title's memory is found before their environment changes
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    while True:
        readable, _, _ = select.select([sock], [], [], 0.1)
        _reap(sock)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        if not data:
            return
        try:
            request = json.loads(data)
            if request.get("entry") not in entry_points or len(fds) < 2:
                answer: dict[str, Any] = {"error": f"unknown entry point {request.get('entry')!r}"}
            elif not single_threaded():
                answer = {"error": "the fork server runs more than one thread"}
            else:
                answer = {"pid": _fork_child(sock, entry_points[request["entry"]], request, fds)}
        except Exception as exc:  # a request it cannot serve: the launcher starts a fresh interpreter
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        for received in fds:
            os.close(received)
        sock.send(json.dumps(answer).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
