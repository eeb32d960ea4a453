"""A request's stream hands its reader the newest cumulative output; a finished output or an
error ends it, and nothing put afterwards replaces them."""

from __future__ import annotations

import asyncio

import pytest

from sonar.engine.async_client import RequestStream
from sonar.outputs import RequestOutput


class Client:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def output(step: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[], prompt_logprobs=None, outputs=[], finished=finished,
        metrics={"step": step},
    )


def drain(stream: RequestStream) -> list:
    async def run() -> list:
        seen = []
        try:
            async for item in stream:
                seen.append(item.metrics["step"])
        except RuntimeError as exc:
            seen.append(str(exc))
        return seen

    return asyncio.run(run())


def test_the_reader_gets_the_newest_output_then_the_finished_one() -> None:
    stream = RequestStream("r", Client())
    for step in range(3):
        stream.put(output(step))
    stream.put(output(3, finished=True))
    stream.put(output(4))  # after the end: ignored
    assert drain(stream) == [3]


def test_an_error_replaces_pending_outputs_and_nothing_replaces_it() -> None:
    stream = RequestStream("r", Client())
    stream.put(output(0))
    stream.put(RuntimeError("engine died"))
    stream.put(output(1, finished=True))
    assert drain(stream) == ["engine died"]


def test_a_waiting_reader_wakes_for_each_put() -> None:
    async def run() -> list[int]:
        stream = RequestStream("r", Client())
        seen: list[int] = []

        async def read() -> None:
            async for item in stream:
                seen.append(item.metrics["step"])

        reader = asyncio.ensure_future(read())
        for step in range(3):
            await asyncio.sleep(0.01)
            stream.put(output(step, finished=step == 2))
        await asyncio.wait_for(reader, 5)
        return seen

    assert asyncio.run(run()) == [0, 1, 2]


def test_closing_an_unfinished_stream_aborts_its_request() -> None:
    client = Client()
    stream = RequestStream("r", client)
    asyncio.run(stream.aclose())
    assert client.aborted == ["r"]
    with pytest.raises(StopAsyncIteration):
        asyncio.run(stream.__anext__())
