"""Questions one API server asks the others of the same ``sonar serve``.

Some state lives in the API server process that admitted a request: the text a Kobold
generation has produced so far, the genkey it runs under. With ``--api-server-count N`` a
client's next request (a Kobold ``check`` or ``abort``) may land on another process, which
then asks its peers. Each API server binds a ZeroMQ ROUTER socket in the server's private IPC
directory and reaches every other one through a DEALER socket; questions and answers are
msgspec structs in msgpack, and a frame that does not decode is logged and dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger("sonar_server")

PEER_TIMEOUT_S = 1.0


class PeerQuestion(msgspec.Struct, forbid_unknown_fields=True):
    """``op``: the registered handler asked; ``key``: its argument (a genkey, say)."""

    id: int
    op: str
    key: str | None = None


class PeerAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``found``: the peer holds what was asked about; ``count``: how many it holds; ``text``:
    what the handler reads back."""

    id: int = 0
    found: bool = False
    count: int = 0
    text: str = ""


Handler = Callable[[str | None], PeerAnswer]


def peer_address(ipc_dir: str, index: int) -> str:
    return f"ipc://{ipc_dir}/peer-{index}"


class ApiServerPeers:
    """This API server's end of the channel among the ``count`` API servers of one server.

    :param ipc_dir: the server's private socket directory (mode 0700).
    :param index: this API server's index.
    :param count: how many API servers there are (1: nobody to ask; ``ask`` answers at once).
    """

    def __init__(self, ipc_dir: str, index: int, count: int) -> None:
        self.ipc_dir, self.index, self.count = ipc_dir, index, count
        self._handlers: dict[str, Handler] = {}
        self._context: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._dealers: list[zmq.asyncio.Socket] = []
        self._pending: dict[int, tuple[asyncio.Future, list[PeerAnswer]]] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._questions = msgspec.msgpack.Decoder(PeerQuestion)
        self._answers = msgspec.msgpack.Decoder(PeerAnswer)

    @property
    def alone(self) -> bool:
        return self.count <= 1

    def handle(self, op: str, handler: Handler) -> None:
        """Answer the question ``op`` with ``handler(key)`` (called on the event loop)."""
        self._handlers[op] = handler

    async def start(self) -> None:
        """Bind this server's socket and connect to the others (no-op when alone)."""
        if self.alone or self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(peer_address(self.ipc_dir, self.index))
        for other in range(self.count):
            if other == self.index:
                continue
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 1000)
            dealer.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer that is gone: it is left out at once
            dealer.setsockopt(zmq.RECONNECT_IVL, 20)  # a peer binding after this one is reached soon after
            dealer.connect(peer_address(self.ipc_dir, other))
            self._dealers.append(dealer)
            self._tasks.append(asyncio.create_task(self._read_answers(dealer)))
        self._tasks.append(asyncio.create_task(self._serve()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_result(None)  # the asker reads what came in so far
        self._pending.clear()
        self._dealers.clear()
        self._router = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def ask(self, op: str, key: str | None = None, timeout: float = PEER_TIMEOUT_S) -> list[PeerAnswer]:
        """Every other API server's answer to ``op`` (``key``); a peer that does not answer
        within ``timeout`` seconds (exited, say) is left out."""
        if self.alone or not self._dealers:
            return []
        question_id = next(self._ids)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        answers: list[PeerAnswer] = []
        self._pending[question_id] = (done, answers)
        try:
            frame = self._encoder.encode(PeerQuestion(question_id, op, key))
            for dealer in self._dealers:
                try:
                    await dealer.send(frame, zmq.NOBLOCK)
                except zmq.Again:  # a peer far behind or gone: leave it out
                    answers.append(PeerAnswer(question_id))
            if len(answers) == len(self._dealers):
                done.set_result(None)
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            logger.warning("%d of %d API server(s) did not answer %s within %.1fs", len(self._dealers) - len(answers), len(self._dealers), op, timeout)
        finally:
            self._pending.pop(question_id, None)
        return [a for a in answers if a.found or a.count]

    async def _read_answers(self, dealer: zmq.asyncio.Socket) -> None:
        while True:
            answer = _decoded(self._answers, await dealer.recv(), "answer")
            if answer is None:
                continue
            pending = self._pending.get(answer.id)
            if pending is None:  # its question timed out
                continue
            done, answers = pending
            answers.append(answer)
            if len(answers) == len(self._dealers) and not done.done():
                done.set_result(None)

    async def _serve(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropped an API server peer message of %d frames", len(frames))
                continue
            identity, frame = frames
            question = _decoded(self._questions, frame, "question")
            if question is None:
                continue
            handler = self._handlers.get(question.op)
            answer = PeerAnswer(question.id)
            if handler is not None:
                try:
                    answer = handler(question.key)
                    answer.id = question.id
                except Exception:
                    logger.exception("answering an API server peer's %s", question.op)
                    answer = PeerAnswer(question.id)
            await self._router.send_multipart([identity, self._encoder.encode(answer)])


def _decoded(decoder: msgspec.msgpack.Decoder, frame: bytes, what: str):
    """``frame`` decoded, or None (logged) where it does not decode into ``decoder``'s type."""
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError included
        logger.warning("dropped an API server peer %s that does not decode: %s", what, exc)
        return None
