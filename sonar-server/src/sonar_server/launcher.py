"""``sonar serve``: check every option that needs no model loaded, bind the port, resolve the
configuration, start the engine cores, then serve HTTP from this process (one API server) or
from ``--api-server-count`` child processes sharing the listening socket; on SIGTERM drain
every process, then stop the engine cores.

The checks and the bind come first and import neither torch nor the engine, so a bad option or
a port in use fails within a second or two."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from sonar.cli.engine_args import engine_args_from
from sonar.cli.preflight import check_before_loading
from sonar.config import EngineArgs
from sonar_server.args import check_server_args, settings_from

logger = logging.getLogger("sonar_server")


def _configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket every API server accepts on, bound before anything is loaded so
    a port in use is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: the event loop sets TCP_NODELAY on the connections of a TCP socket only, and
    # without it a kept-alive connection waits out the client's delayed ACK (~40 ms) between a
    # response's header and body writes; set on the listener too, which Linux's accepted
    # sockets inherit
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _listening(listener, (host, port), f"{host}:{port}", " (is another server running there? pick another --port)")


def _listening(listener: socket.socket, address: Any, where: str, hint: str = "") -> socket.socket:
    """``listener`` bound to ``address`` and listening, inheritable by the API server children."""
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise ValueError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


def bind_unix_listener(path: str) -> socket.socket:
    """``--uds``: the listening socket at a Unix-domain socket path. A socket file left behind
    by a server that is gone is replaced; one a server still answers on, or any other file,
    is refused."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ValueError(f"--uds {path!r} exists and is not a socket; remove it or pick another path")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:  # nothing listens: a stale file
                os.unlink(path)
            else:
                raise ValueError(f"cannot listen on {path}: another server answers there (pick another --uds path)")
    return _listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path, path)


def serve(args: argparse.Namespace) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    _configure_logging()
    engine_args = engine_args_from(args)
    if args.served_model_name:
        engine_args = dataclasses.replace(engine_args, served_model_name=args.served_model_name[0])
    check_server_args(args)
    check_before_loading(engine_args)
    if args.headless:
        return _serve_headless(engine_args)
    listener = bind_unix_listener(args.uds) if args.uds else bind_listener(args.host, args.port)
    try:
        return _serve_on(args, engine_args, listener)
    finally:
        listener.close()
        if args.uds and os.path.exists(args.uds):
            os.unlink(args.uds)


def _serve_headless(engine_args: EngineArgs) -> int:
    """A follower host of a multi-node run: this host's worker ranks only, driven by the head."""
    from sonar.engine.process_util import set_process_title
    from sonar.engine.resolve import resolve_engine_config
    from sonar.executor.node_follower import run_follower
    from sonar.platform import current_platform

    platform = current_platform()
    config, _ = resolve_engine_config(engine_args, platform)
    set_process_title(f"node-{config.node_rank}")
    return run_follower(config, platform)


def _serve_on(args: argparse.Namespace, engine_args: EngineArgs, listener: socket.socket) -> int:
    from sonar.engine.core_client import EngineProcesses, client_addresses, new_ipc_dir
    from sonar.engine.process_util import forks_children, set_process_title
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform
    from sonar_server.api_server import ApiServerLaunch, run_api_server

    platform = current_platform()
    config, tokenizer = resolve_engine_config(engine_args, platform)
    settings = settings_from(args, config.served_name, config.default_sampling)
    ipc_dir = new_ipc_dir()
    count = args.api_server_count
    clients = [client_addresses(ipc_dir, i) for i in range(count)]
    logger.info("loading %s in %d engine core(s)", engine_args.model or "the embedded SmolLM2-135M-Instruct", config.data_parallel_size)
    engines = EngineProcesses(
        config, clients, platform.replica_env, logging.getLevelName(logging.getLogger().level),
        fork=forks_children(platform), close_fds=(listener.fileno(),),
    )
    launches = [
        ApiServerLaunch(
            config=config,
            settings=settings,
            client_index=i,
            addresses=clients[i],
            max_in_flight=config.max_num_seqs * config.data_parallel_size + args.max_waiting_requests,
            engine_step_timeout=args.engine_step_timeout,
            uvicorn_log_level=args.uvicorn_log_level,
            access_log=args.access_log,
            log_level=logging.getLevelName(logger.getEffectiveLevel()),
            listen_fd=listener.fileno(),
            ipc_dir=ipc_dir,
        )
        for i in range(count)
    ]
    try:
        if count == 1:
            set_process_title("api-server-0")
            return run_api_server(launches[0], listener, tokenizer, engines.check_started)
        set_process_title("serve")
        return _supervise(launches, listener, engines)
    finally:
        engines.terminate()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _supervise(launches: list[Any], listener: socket.socket, engines: Any) -> int:
    """Run the API servers (``ApiServerLaunch`` each) as children of this process, watching the
    ``EngineProcesses``; forward one SIGTERM to each child on the first signal. A child that
    exits before it serves (each says so on a pipe) stops them all: ``STARTUP_FAILED``; one
    that exits later, unasked (killed, out of memory, a crash), stops them all too, so that
    what runs the server sees it fail and restarts it rather than a server short of a
    process: ``API_SERVER_DIED``."""
    import msgspec

    from sonar_server.api_server import API_SERVER_DIED, SERVING, STARTUP_FAILED

    metrics_dir = tempfile.mkdtemp(prefix="sonar-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    children: list[subprocess.Popen] = []
    starting: dict[int, int] = {}  # a ready pipe's read end -> the index of its child, not serving yet
    unstarted: set[int] = set()  # children whose pipe closed before they served: they exited first
    stopping = threading.Event()

    def stop(sig: int, frame: FrameType | None) -> None:
        if stopping.is_set():  # a second signal: stop at once
            for child in children:
                if child.poll() is None:
                    child.kill()
            return
        stopping.set()
        logger.info("%s received: draining every API server", signal.Signals(sig).name)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index, launch in enumerate(launches):
            ready_read, ready_write = os.pipe()
            starting[ready_read] = index
            try:
                child = subprocess.Popen(
                    [sys.executable, "-m", "sonar_server.api_server"],
                    stdin=subprocess.PIPE, pass_fds=[listener.fileno(), ready_write], env=env, start_new_session=True,
                )
            finally:
                os.close(ready_write)  # the child's copy is the only one: its exit closes the pipe
            assert child.stdin is not None
            child.stdin.write(msgspec.json.encode(msgspec.structs.replace(launch, ready_fd=ready_write)))
            child.stdin.close()
            children.append(child)
        while any(child.poll() is None for child in children):
            engines.reap()
            unstarted |= _note_serving(starting, SERVING, timeout=0.2)
            exited = [i for i, child in enumerate(children) if child.poll() is not None]
            if exited and not stopping.is_set():
                not_serving = unstarted | set(starting.values())
                index = next((i for i in exited if i in not_serving), exited[0])  # a start-up failure first
                reason = _exit_reason(children[index].returncode)
                if index in not_serving:  # e.g. a bad --lora-modules adapter, or any error before serving
                    logger.error(
                        "API server %d exited (%s) before it started serving; see its error above. Stopping every API server and engine core",
                        index, reason,
                    )
                    code = STARTUP_FAILED
                else:
                    logger.error("API server %d exited (%s) while serving; stopping every API server and engine core", index, reason)
                    code = API_SERVER_DIED
                _stop(children)
                return code
        return 0 if stopping.is_set() else max(child.returncode for child in children)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(children, grace_s=0.0)
        for fd in starting:
            os.close(fd)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _exit_reason(returncode: int) -> str:
    """A child's exit as a log says it: ``code 1``, or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"code {returncode}"


def _note_serving(starting: dict[int, int], serving: bytes, timeout: float) -> set[int]:
    """Wait up to ``timeout`` for the ready pipes in ``starting`` and close those that spoke,
    dropping them from it; returns the indices of the children whose pipe closed without
    ``serving`` (they exited before serving)."""
    if not starting:
        time.sleep(timeout)
        return set()
    closed_early: set[int] = set()
    readable, _, _ = select.select(list(starting), [], [], timeout)
    for fd in readable:
        if os.read(fd, len(serving)) != serving:
            closed_early.add(starting[fd])
        else:
            logger.info("API server %d is serving", starting[fd])
        del starting[fd]
        os.close(fd)
    return closed_early


def _stop(children: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every child still running, SIGKILL those still running ``grace_s`` later, and
    reap them all: none is left behind."""
    for child in children:
        if child.poll() is None and grace_s > 0:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
