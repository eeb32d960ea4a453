"""A trial compilation in a process of its own, so that one that runs too long can be killed.

xgrammar cannot stop a compilation once it has started, and some constraints that are valid and
small on the wire take tens of seconds (a JSON schema of a thousand optional properties, a
choice among thousands of long strings). Compiled in a thread, such a constraint kept its
thread long after its request was refused. So each new constraint is first compiled in a child
process (``python -m sonar.structured_output.compile_worker``) that holds xgrammar's compiler for
the model's vocabulary; one past its time limit is ended by killing the process (a new one takes
its place). One that compiles in time is then compiled again where it is used, in a thread: the
trial has shown it finishes. The compiled grammar itself does not cross: xgrammar's text form of
it grows far faster than the grammar (70 MB for a schema of 200 optional string properties).

The processes talk over their standard input and output in frames: a 4-byte big-endian length,
then that many bytes of UTF-8 JSON. The first frame to a child is its vocabulary
(``TokenizerInfo.serialize_json``), answered by ``{"ready": true}`` once its compiler is built;
each later one a constraint, answered by ``{"ok": true}`` or an error message. A constraint's
time limit runs from when it is sent to a ready process: the start of a process (seconds of
imports on a busy host) is not the constraint's. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import re
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any

_LENGTH = struct.Struct(">I")
#: the largest frame either side accepts (a vocabulary of a few hundred thousand tokens is
#: well within it)
MAX_FRAME_BYTES = 1 << 30
#: how long a compile process may take to start (import xgrammar, read the vocabulary)
START_TIMEOUT_S = 120.0
# xgrammar writes the characters of a length-bounded JSON string as this class, which admits
# control characters JSON forbids; swapped for the class its unbounded strings use
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_XGRAMMAR_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    return _XGRAMMAR_LOCATION.sub("", str(exc)).strip() or type(exc).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def compile_constraint(compiler: Any, request: dict[str, Any]) -> Any:
    """``request`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``): ``{"kind":
    "json", "spec": schema text}``, ``{"kind": "json_object"}``, ``{"kind": "regex" or
    "grammar", "spec": text}`` or ``{"kind": "choice", "spec": [strings]}``."""
    import xgrammar as xgr

    kind, spec = request["kind"], request.get("spec")
    if kind in ("json", "json_object"):
        schema = spec if kind == "json" else '{"type": "object"}'
        # compact JSON: free whitespace would let a model pad forever
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=kind == "json")
        text = str(grammar)
        if _LENGTH_BOUNDED_CHAR in text:  # that class lets raw control characters into strings
            return compiler.compile_grammar(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))
        return compiler.compile_grammar(grammar)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=False).encode()
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame of a blocking stream; None at its end."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data)


class CompileTimeout(Exception):
    """A compilation passed its time limit; its process was killed."""


class CompileWorker:
    """One compile process (started here): xgrammar's compiler over a model's vocabulary, fed
    one constraint to try at a time.

    :param tokenizer_info_json: the vocabulary, as ``xgrammar.TokenizerInfo.serialize_json``
        writes it.
    :param num_threads: the threads xgrammar may use for one compilation.
    """

    def __init__(self, tokenizer_info_json: str, num_threads: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sonar.structured_output.compile_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._buffer = bytearray()
        self._started = False
        assert self.process.stdin is not None
        write_frame(self.process.stdin, {"tokenizer_info": tokenizer_info_json, "num_threads": num_threads})

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once the process has built its compiler (at once after the first time).

        :raises RuntimeError: it ended, or did not start within ``timeout_s`` (it is killed).
        """
        if self._started:
            return
        try:
            reply = self._read_reply(time.monotonic() + timeout_s)
        except CompileTimeout:
            raise RuntimeError(f"the grammar compile process did not start within {timeout_s:g} s") from None
        if not reply.get("ready"):
            self.kill()
            raise RuntimeError(f"the grammar compile process answered {reply!r} to its vocabulary")
        self._started = True

    def compile(self, request: dict[str, Any], timeout_s: float) -> None:
        """Compile ``request`` in the process (the result stays there), once it has started.

        :raises CompileTimeout: not done within ``timeout_s`` of the process being ready (the
            process is killed).
        :raises RuntimeError: the constraint does not compile (xgrammar's message), or the
            process ended or never started (it is killed).
        """
        self.wait_started()
        assert self.process.stdin is not None
        try:
            write_frame(self.process.stdin, request)
        except (BrokenPipeError, OSError):
            self.kill()
            raise RuntimeError("the grammar compile process exited") from None
        reply = self._read_reply(time.monotonic() + timeout_s)
        if "error" in reply:
            raise RuntimeError(str(reply["error"]))

    def _read_reply(self, deadline: float) -> dict[str, Any]:
        """One frame from the process, read as it arrives until ``deadline``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        needed = _LENGTH.size
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(self._buffer)
                if size > MAX_FRAME_BYTES:
                    self.kill()
                    raise RuntimeError(f"the grammar compile process sent a frame of {size} bytes")
                needed = _LENGTH.size + size
                if len(self._buffer) >= needed:
                    data = bytes(self._buffer[_LENGTH.size : needed])
                    del self._buffer[:needed]
                    return json.loads(data)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise CompileTimeout()
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, max(1 << 16, needed - len(self._buffer)))
            if not chunk:
                self.kill()
                raise RuntimeError("the grammar compile process exited")
            self._buffer += chunk

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """End the process (a compilation in it is lost) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def main() -> int:
    """A compile process: its vocabulary, then constraints to try, one at a time, until its
    input ends (or its parent dies)."""
    from sonar.engine.process_util import exit_with_parent, set_process_title

    exit_with_parent()
    set_process_title("grammar-compile")
    import xgrammar as xgr

    source = sys.stdin.buffer
    sink = os.fdopen(os.dup(1), "wb")  # the frames' own channel:
    os.dup2(2, 1)  # anything else written to standard output goes to standard error
    setup = read_frame(source)
    if setup is None:
        return 0
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(setup.get("num_threads", 1)), cache_enabled=False)
    write_frame(sink, {"ready": True})
    while (request := read_frame(source)) is not None:
        try:
            compile_constraint(compiler, request)
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            reply = {"error": clean_error(exc)}
        write_frame(sink, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
