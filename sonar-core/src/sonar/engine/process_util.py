"""What every Sonar process does about its identity and its parent: a role in its process
title (``sonar::engine-core-0``), and an exit when the process that started it dies."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_process_title(role: str) -> None:
    """Name this process ``sonar::<role>`` in ``ps`` and ``top``."""
    try:
        import setproctitle
    except ImportError:  # optional where it cannot be installed
        logger.debug("setproctitle is not installed; the process keeps its title")
        return
    setproctitle.setproctitle(f"sonar::{role}")


def exit_with_parent() -> None:
    """Die when the parent dies: the kernel's parent-death signal where there is one (Linux),
    and a watchdog thread that notices a new parent (re-parenting) everywhere."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="sonar-parent-watch", daemon=True).start()
