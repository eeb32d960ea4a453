"""What every Sonar process does about its identity, its parent and its heap: a role in its
process title (``sonar::engine-core-0``), an exit when the process that started it dies, a
garbage collector tuned for serving once startup is over, and a child started by forking this
process where that is sound (``ForkedProcess``)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# allocations net of frees between young-generation collections (Python's default is 700)
SERVING_GEN0_THRESHOLD = 5000


def set_process_title(role: str) -> None:
    """Name this process ``sonar::<role>`` in ``ps`` and ``top``."""
    try:
        import setproctitle
    except ImportError:  # optional where it cannot be installed
        logger.debug("setproctitle is not installed; the process keeps its title")
        return
    setproctitle.setproctitle(f"sonar::{role}")


def exit_with_parent(watchdog: bool = True) -> None:
    """Die when the parent dies: the kernel's parent-death signal where there is one (Linux),
    and a watchdog thread that notices a new parent (re-parenting) everywhere (``watchdog``:
    not in a process that must stay single-threaded to fork, which watches its parent
    otherwise)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)
    if not watchdog:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="sonar-parent-watch", daemon=True).start()


def freeze_startup_heap() -> None:
    """Call once startup is over (model, tokenizer and app built): every object alive now is
    moved out of the collector's sight (``gc.freeze``), and young collections run after 5,000
    net allocations instead of 700.

    A serving process allocates a few short-lived containers per token of every stream, and
    almost all of them die by reference counting. With the defaults, an API server streaming
    500 requests ran about 1,400 young collections a burst and full ones that walked the whole
    startup heap (its tokenizer, the app) at ~180 ms each, pausing the event loop; 22% of its
    CPU time went to the collector. Cycles are still collected, only later."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, gen1, gen2)


_OPENBLAS_THREAD_COUNTS = ("openblas_get_num_threads", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads")


def _openblas_pool_threads() -> int:
    """Worker threads of the OpenBLAS libraries loaded in this process (numpy's starts its pool
    when imported). OpenBLAS stops its pool before a fork and starts it again in each process
    when next used, so these threads cannot leave a lock held in a child."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return 0
    workers = 0
    for path in paths:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        count = next((getattr(library, name) for name in _OPENBLAS_THREAD_COUNTS if hasattr(library, name)), None)
        if count is not None:
            workers += max(0, int(count()) - 1)  # the calling thread is one of its threads
    return workers


#: ``spawn``: start every engine core and worker rank as a fresh interpreter, even where the
#: platform allows forking (``fork``, the default, forks where ``Platform.fork_children``).
START_METHOD_ENV = "SONAR_WORKER_MULTIPROC_METHOD"


def forks_children(platform: Any) -> bool:
    """Whether engine cores and worker ranks may be forked on ``platform``: it allows it
    (``Platform.fork_children``) and ``SONAR_WORKER_MULTIPROC_METHOD`` is not ``spawn``."""
    method = os.environ.get(START_METHOD_ENV, "fork").strip().lower()
    if method not in ("fork", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'fork' or 'spawn'")
    return bool(platform.fork_children) and method == "fork"


def single_threaded() -> bool:
    """Whether this process runs one thread now, not counting OpenBLAS's pool (Linux:
    ``/proc/self/task``): the condition for a fork whose child starts sound, as no other
    thread can hold a lock the child inherits (the allocator's, the logging module's, a thread
    pool's). False where it cannot be told."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return threading.active_count() == 1 and (threads == 1 or threads <= 1 + _openblas_pool_threads())


def _forget_parent_exit_handlers() -> None:
    """In a forked child: drop the exit handlers its parent registered (a temporary
    directory's cleanup, a server's shutdown) so that only the child's own run when it exits,
    as in a fresh interpreter. ``weakref.finalize`` keeps its own registry: the parent's
    entries stop running at exit, and the child's new ones register again."""
    atexit._clear()
    for info in list(weakref.finalize._registry.values()):  # type: ignore[attr-defined]
        info.atexit = False
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]


class ChildSignals:
    """``send_signal``, ``terminate`` and ``kill`` as ``subprocess.Popen`` has them, for a
    child handle with ``pid`` and ``poll()``: a child that has exited gets no signal."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(ChildSignals):
    """A child forked from this process that runs ``target()`` and exits with its return
    value, with the part of ``subprocess.Popen`` Sonar's launchers use (``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``).

    The child starts with every module its parent imported (torch, Sonar, the model code),
    which a fresh interpreter spends seconds of CPU importing again. It runs in its own
    session, with ``environ`` added to its environment, default SIGINT and SIGTERM handlers,
    ``close_fds`` closed (a listening socket it must not hold) and only its own exit handlers.
    Fork only where ``single_threaded()`` holds and the device runtime survives a fork
    (``Platform.fork_children``)."""

    def __init__(self, target: Callable[[], int], environ: dict[str, str] | None = None, close_fds: Sequence[int] = ()) -> None:
        try:  # it finds the title's memory from the environment: before a child changes it
            import setproctitle

            setproctitle.getproctitle()
        except ImportError:
            pass
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into its parent's frames
            code = 1
            try:
                os.setsid()
                for fd in close_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _forget_parent_exit_handlers()
                os.environ.update(environ or {})
                code = target()
                atexit._run_exitfuncs()
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None
        self.args = f"fork of {os.getpid()}"

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                self.returncode = 0
                return 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode  # type: ignore[return-value]
