"""How much of ``sonar bench serve``'s figures is the client's own work, per HTTP client:

    python sonar-server/benchmarks/bench_client_overhead.py --clients httpx,aiohttp,own --repeat 3

A local SSE server in its own process answers POST /v1/completions (and /v1/chat/completions)
with OpenAI-shaped chunks in chunked transfer coding, as uvicorn sends them: a chunk every
``--interval-ms`` per stream (all streams on one clock, as an engine steps every sequence at once),
or all at once with ``--interval-ms 0``; then a usage chunk and ``data: [DONE]``. It records when
it had each request's body in full and when it sent each stream's last bytes; CLOCK_MONOTONIC
(``time.perf_counter`` on Linux) is shared by both processes. For each client, N requests of
~6 KB sent at once, as the bench's measured run sends them:

    (a) client start -> the last request body in at the server
    (b) the server's last bytes sent -> the client done
    (c) the client's wall time against the ideal (chunks x interval), and its CPU time;
        the ITL it measured against the server's interval

``httpx`` is the bench's former client (pools of 16 streams), ``aiohttp`` vLLM's, ``own``
``sonar_server.stream_client`` through the bench's ``send_request``; ``--loops asyncio,uvloop``
runs each under both event loops where uvloop is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

CHUNK_TEXT = " word"
STREAMS_PER_POOL = 16
REQUEST_TIMEOUT_S = 6 * 3600.0


# the server


def _event(data: dict[str, Any] | str) -> bytes:
    """One SSE event as one HTTP chunk."""
    event = b"data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def stream_frames(chat: bool, num_chunks: int) -> tuple[list[bytes], bytes]:
    """The chunks of one answer, one per tick, and the usage, [DONE] and end of body after the last."""
    if chat:
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        frames = [_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})]
        content = {**base, "choices": [{"index": 0, "delta": {"content": CHUNK_TEXT}, "finish_reason": None}]}
        frames[0] += _event(content)
        frames += [_event(content) for _ in range(num_chunks - 1)]
    else:
        base = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}
        content = {**base, "choices": [{"index": 0, "text": CHUNK_TEXT, "logprobs": None, "finish_reason": None}]}
        frames = [_event(content) for _ in range(num_chunks)]
    usage = {**base, "choices": [], "usage": {"prompt_tokens": 1024, "completion_tokens": num_chunks, "total_tokens": 1024 + num_chunks}}
    return frames, _event(usage) + _event("[DONE]") + b"0\r\n\r\n"


class SSEServer:
    """Answers completions with paced SSE chunks and records when each request came and left."""

    def __init__(self, interval: float, num_chunks: int) -> None:
        self.interval = interval
        self.frames = {path: stream_frames(path.endswith("chat/completions"), num_chunks) for path in ("/v1/completions", "/v1/chat/completions")}
        self.streams: list[list[Any]] = []  # [transport, frames, ending, next frame index]
        self.received: list[float] = []
        self.last_sent: list[float] = []
        self.max_lateness = 0.0

    def answer(self, transport: asyncio.Transport, method: str, path: str, received: float) -> None:
        if path == "/stats":
            stats = {"received": self.received, "last_sent": self.last_sent, "max_lateness": self.max_lateness}
            body = json.dumps(stats).encode()
            transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            return
        if method != "POST" or path not in self.frames:
            body = b'{"error":{"message":"not found","code":404}}'
            transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            return
        self.received.append(received)
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
        frames, ending = self.frames[path]
        if self.interval:
            self.streams.append([transport, frames, ending, 0])
            return
        for frame in frames:
            transport.write(frame)
        transport.write(ending)
        self.last_sent.append(time.perf_counter())

    async def tick(self) -> None:
        """Every interval, the next chunk of every stream (absolute ticks: no drift)."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self.interval
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            self.max_lateness = max(self.max_lateness, loop.time() - next_tick)
            streaming = []
            for stream in self.streams:
                transport, frames, ending, index = stream
                if transport.is_closing():
                    continue
                transport.write(frames[index])
                stream[3] = index + 1
                if index + 1 < len(frames):
                    streaming.append(stream)
                else:
                    transport.write(ending)
                    self.last_sent.append(time.perf_counter())
            self.streams = streaming


class HTTPConnection(asyncio.Protocol):
    """HTTP/1.1 requests with Content-Length bodies, kept alive."""

    def __init__(self, server: SSEServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.request: tuple[str, str, int] | None = None  # method, path, body length

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.request is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                request_line, *lines = self.buffer[:end].decode("latin-1").split("\r\n")
                del self.buffer[: end + 4]
                method, path, _ = request_line.split(" ", 2)
                length = 0
                for line in lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                self.request = (method, path, length)
            method, path, length = self.request
            if len(self.buffer) < length:
                return
            del self.buffer[:length]
            self.request = None
            self.server.answer(self.transport, method, path, time.perf_counter())


async def serve(interval: float, num_chunks: int) -> None:
    server = SSEServer(interval, num_chunks)
    listener = await asyncio.get_running_loop().create_server(lambda: HTTPConnection(server), "127.0.0.1", 0, backlog=4096)
    print(listener.sockets[0].getsockname()[1], flush=True)
    await server.tick() if interval else await asyncio.Event().wait()


# the clients


async def send_httpx(client: Any, url: str, body: dict[str, Any], request: Any) -> Any:
    """The bench's former request function, on an httpx pool."""
    from sonar_server.bench_serve import RequestOutput, StreamReading, _error_message

    output = RequestOutput(prompt_len=request.prompt_len)
    try:
        reading = StreamReading(output)
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                output.error = f"HTTP {response.status_code}: {_error_message(text)}"
                return output
            async for line in response.aiter_lines():
                if not reading.take(line.encode()):
                    break
        return reading.finish()
    except Exception as exc:
        output.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return output


async def send_aiohttp(session: Any, url: str, body: bytes, request: Any) -> Any:
    """The same request and timing on an aiohttp session."""
    from sonar_server.bench_serve import RequestOutput, StreamReading, _error_message

    output = RequestOutput(prompt_len=request.prompt_len)
    try:
        reading = StreamReading(output)
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                output.error = f"HTTP {response.status}: {_error_message(text)}"
                return output
            async for line in response.content:
                if not reading.take(line):
                    break
        return reading.finish()
    except Exception as exc:
        output.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return output


async def measure_client(client: str, base_url: str, endpoint: str, num_requests: int, input_len: int) -> dict[str, Any]:
    """One warm-up request, then ``num_requests`` at once, timed as the bench times them."""
    from sonar_server.bench_serve import BenchRequest, encode_body, percentile, request_body, send_request
    from sonar_server.stream_client import StreamClient

    chat = endpoint.endswith("chat/completions")
    rng = random.Random(0)
    requests = [BenchRequest([rng.randrange(100, 32000) for _ in range(input_len)], input_len, 128) for _ in range(num_requests)]
    if chat:
        requests = [BenchRequest(" ".join(str(t) for t in r.prompt), input_len, 128) for r in requests]
    bodies = [request_body(r, "m", chat, ignore_eos=True) for r in requests]
    url = base_url + endpoint
    closers = []
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        pools = [httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0), limits=limits) for _ in range(-(-num_requests // STREAMS_PER_POOL))]
        closers = [pool.aclose for pool in pools]
        turn = itertools.count()

        def send(body: Any, request: Any) -> Any:
            return send_httpx(pools[next(turn) % len(pools)], url, body, request)

    elif client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=30.0))
        closers = [session.close]
        bodies = [encode_body(body) for body in bodies]

        def send(body: Any, request: Any) -> Any:
            return send_aiohttp(session, url, body, request)

    else:
        stream_client = StreamClient(base_url)
        closers = [stream_client.aclose]
        bodies = [encode_body(body) for body in bodies]

        def send(body: Any, request: Any) -> Any:
            return send_request(stream_client, endpoint, body, request)

    warmup = await send(bodies[0], requests[0])
    assert warmup.success, warmup.error
    cpu_started = time.process_time()
    started = time.perf_counter()
    tasks = [asyncio.create_task(send(body, request)) for body, request in zip(bodies, requests)]
    outputs = await asyncio.gather(*tasks)
    finished = time.perf_counter()
    cpu = time.process_time() - cpu_started
    for close in closers:
        await close()
    errors = sorted({o.error for o in outputs if not o.success})
    good = sum(o.success and o.output_tokens == 128 and len(o.itl) == 127 for o in outputs)
    itl_ms = [1000 * gap for o in outputs for gap in o.itl]
    return {
        "started": started,
        "finished": finished,
        "cpu_s": cpu,
        "itl_p50_ms": percentile(itl_ms, 50),
        "itl_p99_ms": percentile(itl_ms, 99),
        "completed": good,
        "failed": len(outputs) - good,
        "errors": errors[:3],
    }


def run_client(args: argparse.Namespace) -> None:
    coroutine = measure_client(args.client, args.url, args.endpoint, args.num_requests, args.input_len)
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(coroutine)
    else:
        result = asyncio.run(coroutine)
    print(json.dumps(result), flush=True)


# the comparison


def one_run(client: str, loop: str, interval_ms: float, args: argparse.Namespace) -> dict[str, float]:
    server = subprocess.Popen([sys.executable, __file__, "serve", "--interval-ms", str(interval_ms), "--num-chunks", "128"], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        command = [sys.executable, __file__, "client", "--url", url, "--client", client, "--loop", loop, "--endpoint", args.endpoint]
        command += ["--num-requests", str(args.num_requests), "--input-len", str(args.input_len)]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{client} client failed:\n{done.stderr}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        import urllib.request

        stats = json.loads(urllib.request.urlopen(f"{url}/stats").read())
    finally:
        server.kill()
        server.wait()
    received = [t for t in stats["received"] if t >= measured["started"]]
    last_sent = stats["last_sent"][-len(received) :]
    ideal = 128 * interval_ms / 1000
    wall = measured["finished"] - measured["started"]
    if measured["failed"]:
        print(f"  {client}/{loop}: {measured['failed']} failed: {measured['errors']}", file=sys.stderr)
    return {
        "requests_in_s": max(received) - measured["started"],
        "drain_s": measured["finished"] - max(last_sent),
        "wall_s": wall,
        "ideal_s": ideal,
        "overhead_s": wall - ideal,
        "cpu_s": measured["cpu_s"],
        "itl_p50_ms": measured["itl_p50_ms"],
        "itl_p99_ms": measured["itl_p99_ms"],
        "failed": measured["failed"],
        "server_lateness_ms": 1000 * stats["max_lateness"],
    }


def compare(args: argparse.Namespace) -> None:
    loops = [loop for loop in args.loops.split(",") if loop != "uvloop" or _has_uvloop()]
    print(f"{args.num_requests} requests at once, {args.input_len}-token prompts, 128 chunks each, {args.endpoint}; median of {args.repeat}")
    header = f"{'interval':>8} {'client':>8} {'loop':>8} | {'(a) in s':>8} {'(b) out s':>9} {'wall s':>7} {'ideal s':>7} {'over s':>7} {'cpu s':>6} {'ITL p50/p99 ms':>14} {'fail':>4} {'srv late ms':>11}"
    print(header)
    print("-" * len(header))
    results = []
    for interval_ms in [float(i) for i in args.intervals_ms.split(",")]:
        for client in args.clients.split(","):
            for loop in loops:
                runs = [one_run(client, loop, interval_ms, args) for _ in range(args.repeat)]
                row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                results.append({"interval_ms": interval_ms, "client": client, "loop": loop, **row})
                print(
                    f"{interval_ms:>8g} {client:>8} {loop:>8} | {row['requests_in_s']:>8.3f} {row['drain_s']:>9.3f} {row['wall_s']:>7.3f} "
                    f"{row['ideal_s']:>7.3f} {row['overhead_s']:>7.3f} {row['cpu_s']:>6.2f} {row['itl_p50_ms']:>6.1f}/{row['itl_p99_ms']:<7.1f} {row['failed']:>4g} {row['server_lateness_ms']:>11.1f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    server = commands.add_parser("serve", help="run the SSE server alone (prints its port)")
    server.add_argument("--interval-ms", type=float, default=8.0)
    server.add_argument("--num-chunks", type=int, default=128)
    client = commands.add_parser("client", help="one client's measured run against a running server")
    client.add_argument("--url", required=True)
    client.add_argument("--client", choices=["httpx", "aiohttp", "own"], default="own")
    client.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    for command in (parser, client):
        command.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
        command.add_argument("--num-requests", type=int, default=500)
        command.add_argument("--input-len", type=int, default=1024, help="token ids per prompt (~6 KB of JSON at 1,024)")
    parser.add_argument("--clients", default="httpx,aiohttp,own")
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--intervals-ms", default="8,0", help="chunk intervals to run, 0: every chunk at once")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.command == "serve":
        loop_run = asyncio.run
        if _has_uvloop():
            import uvloop

            loop_run = uvloop.run
        loop_run(serve(args.interval_ms / 1000, args.num_chunks))
    elif args.command == "client":
        run_client(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
