"""``AsyncLLM`` over a scripted fake engine: errors, aborts, the queue bound, a dead engine."""

from __future__ import annotations

import asyncio
import contextlib
import time
import threading

import pytest

from sonar.engine.async_client import AsyncLLM, EngineDeadError, QueueFull
from sonar.outputs import CompletionOutput, RequestOutput
from sonar.sampling_params import SamplingParams


class FakeEngine:
    """Emits one token per step per request; ``fail_on_step`` makes a step raise."""

    tokenizer = None
    model_config = None

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_on_step = fail_on_step
        self.thread_names: set[str] = set()

    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> None:
        self.thread_names.add(threading.current_thread().name)
        if params.max_tokens is not None and params.max_tokens > 100:
            raise ValueError(f"max_tokens={params.max_tokens} exceeds the model's context of 100 tokens")
        self.requests[request_id] = ([], params)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.aborted.extend(r for r in request_ids if r in self.requests)
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_names.add(threading.current_thread().name)
        self.num_steps += 1
        time.sleep(0.001)
        if self.fail_on_step == self.num_steps:
            raise RuntimeError("device lost")
        outputs = []
        for request_id, (tokens, params) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= (params.max_tokens or 16)
            completion = CompletionOutput(0, "x" * len(tokens), list(tokens), None, None, "length" if done else None)
            outputs.append(RequestOutput(request_id, None, [1], None, [completion], done))
            if done:
                del self.requests[request_id]
        return outputs

    def get_stats(self) -> dict[str, int]:
        return {"num_running": len(self.requests)}


def test_generate_streams_cumulative_outputs_from_the_engine_thread():
    async def main() -> list[RequestOutput]:
        client = AsyncLLM(engine)
        outputs = [o async for o in client.generate("a", [1, 2], SamplingParams(max_tokens=5))]
        client.shutdown()
        return outputs

    engine = FakeEngine()
    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
    assert engine.thread_names == {"sonar-engine"}


def test_bad_request_raises_value_error_and_the_loop_lives_on():
    async def main() -> None:
        client = AsyncLLM(FakeEngine())
        with pytest.raises(ValueError, match="max_tokens=500"):
            await client.add_request("bad", [1], SamplingParams(max_tokens=500))
        outputs = [o async for o in client.generate("good", [1], SamplingParams(max_tokens=2))]
        assert outputs[-1].finished
        assert client.is_healthy() and client.num_in_flight == 0
        client.shutdown()

    asyncio.run(main())


def test_closing_a_stream_early_aborts_the_request():
    engine = FakeEngine()

    async def main() -> None:
        client = AsyncLLM(engine)
        async with contextlib.aclosing(client.generate("leaver", [1], SamplingParams(max_tokens=90))) as outputs:
            async for _ in outputs:
                break
        for _ in range(100):
            if client.num_in_flight == 0 and not engine.requests:
                break
            await asyncio.sleep(0.01)
        client.shutdown()

    asyncio.run(main())
    assert engine.aborted == ["leaver"]


def test_queue_bound_raises_queue_full():
    async def main() -> None:
        client = AsyncLLM(FakeEngine(), max_in_flight=2)
        first = await client.add_request("a", [1], SamplingParams(max_tokens=90))
        second = await client.add_request("b", [1], SamplingParams(max_tokens=90))
        with pytest.raises(QueueFull):
            await client.add_request("c", [1], SamplingParams(max_tokens=90))
        await first.aclose()
        await second.aclose()
        client.shutdown()

    asyncio.run(main())


def test_a_failing_step_fails_every_stream_and_marks_the_client_dead():
    async def main() -> None:
        client = AsyncLLM(FakeEngine(fail_on_step=3))
        stream = await client.add_request("a", [1], SamplingParams(max_tokens=50))
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        assert not client.is_healthy()
        with pytest.raises(EngineDeadError):
            await client.add_request("b", [1], SamplingParams(max_tokens=5))

    asyncio.run(main())
