"""``sonar bench serve`` against the shared tiny server and against one it launches: the
numbers it reports, its JSON result, failed requests counted, and the metric arithmetic; its
streaming client against a scripted local server: chunked, Content-Length and close-delimited
bodies split anywhere, CRLF, HTTP and mid-stream errors, dropped connections, timeouts, https."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import re
import shutil
import ssl
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, sonar_command
from sonar_server.bench_serve import BenchRequest, RequestOutput, percentile, send_request, summarize
from sonar_server.stream_client import ChunkedDecoder, LineSplitter, StreamClient

SMALL = ["--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "8", "--disable-tqdm"]
ALL_METRICS = ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]


def bench(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[dict, str]:
    """Run ``sonar bench serve ARGS --save-result`` and return its JSON result and stdout."""
    command = [*sonar_command(), "bench", "serve", *args, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return json.loads((tmp_path / "result.json").read_text()), done.stdout


def assert_ordered(result: dict, metric: str) -> None:
    assert 0 < result[f"p50_{metric}_ms"] <= result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result[f"median_{metric}_ms"] == result[f"p50_{metric}_ms"]


def test_completions_with_token_id_prompts(server, tmp_path):
    result, stdout = bench(tmp_path, "--base-url", server.url, *SMALL, "--max-concurrency", "4", *ALL_METRICS, "--goodput", "e2el:60000")
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["model_id"] == "tiny"  # asked of /v1/models
    assert result["total_input_tokens"] == 8 * 16  # token-id prompts: exact
    assert result["total_output_tokens"] == 8 * 8  # ignore_eos
    duration = result["duration"]
    assert duration > 0
    assert result["request_throughput"] == pytest.approx(8 / duration)
    assert result["output_throughput"] == pytest.approx(64 / duration)
    assert result["total_token_throughput"] == pytest.approx((128 + 64) / duration)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # a minute of e2el: all good
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert_ordered(result, metric)
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"] <= 1000 * duration
    assert "============ Serving Benchmark Result ============" in stdout
    assert "Successful requests:                     8" in stdout
    assert "P90 ITL (ms):" in stdout and "Request goodput (req/s):" in stdout


def test_chat_prompts_close_to_the_requested_length(server, tmp_path):
    result, stdout = bench(tmp_path, "--base-url", server.url, "--endpoint", "/v1/chat/completions", *SMALL, "--max-concurrency", "4", "--save-detailed")
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 8 * 8
    assert result["output_lens"] == [8] * 8
    assert all(len(gaps) <= 7 for gaps in result["itls"])
    # the prompt is the chat template around 16 tokens of words
    empty = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": ""}]}).json()["count"]
    assert all(abs(n - empty - 16) <= 2 for n in result["input_lens"]), (empty, result["input_lens"])
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert "Mean TPOT (ms):" in stdout and "E2EL" not in stdout  # default metrics: ttft,tpot,itl


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Name three rivers of Europe, please."}, {"from": "gpt", "value": "The Danube, the Rhine and the Loire flow through Europe."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there, how can I help you today?"}]},  # prompt under 4 tokens: skipped
    {"id": "c", "conversations": [{"from": "human", "value": "Write a haiku about the sea at night."}, {"from": "gpt", "value": "Dark waves fold silver, the moon walks on salt water, a gull sleeps offshore."}]},
    {"id": "d", "conversations": [{"from": "human", "value": "only one turn"}]},  # no reply: skipped
]


def test_sharegpt_prompts_with_their_replies_lengths(server, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    result, _ = bench(tmp_path, "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "6",
                      "--disable-tqdm", "--save-detailed")
    tokens = {item["id"]: [httpx.post(f"{server.url}/tokenize", json={"prompt": turn["value"], "add_special_tokens": False}).json()["count"]
                           for turn in item["conversations"]] for item in SHAREGPT}
    assert (result["completed"], result["failed"]) == (6, 0)
    assert sorted(set(result["output_lens"])) == sorted({tokens["a"][1], tokens["c"][1]})  # ignore_eos: each reply's length
    assert sorted(set(result["input_lens"])) == sorted({tokens["a"][0], tokens["c"][0]})
    chat, _ = bench(tmp_path, "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "2",
                    "--sharegpt-output-len", "5", "--endpoint", "/v1/chat/completions", "--disable-tqdm")
    assert (chat["completed"], chat["total_output_tokens"]) == (2, 10)


def test_custom_prompts_from_json_lines(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Tell me about tides."}\n\n{"turns": ["What is 2 + 2?", "And 3 + 3?"]}\n')
    result, _ = bench(tmp_path, "--base-url", server.url, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "5",
                      "--custom-output-len", "4", "--disable-tqdm")
    assert (result["completed"], result["total_output_tokens"]) == (5, 20)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no prompt field"}\n')
    command = [*sonar_command(), "bench", "serve", "--base-url", server.url, "--dataset-name", "custom", "--dataset-path", str(bad)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "bad.jsonl:1: needs a text field (turns, prompt, text, question, instruction)" in done.stderr


def test_request_rate_spaces_arrivals(server, tmp_path):
    result, _ = bench(tmp_path, "--base-url", server.url, *SMALL, "--request-rate", "20", "--seed", "5")
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 64)
    assert result["request_rate"] == 20.0
    arrival = random.Random(5 + 1)  # the arrival gaps are seeded by --seed
    last_arrival = sum(arrival.expovariate(20) for _ in range(7))
    assert result["duration"] > last_arrival


def test_failed_requests_are_counted_not_fatal(server, tmp_path):
    # prompts of 200..600 tokens on a 512-token context: some are refused with a 400
    args = ["--num-prompts", "20", "--random-input-len", "400", "--random-range-ratio", "0.5", "--random-output-len", "4", "--seed", "3"]
    result, stdout = bench(tmp_path, "--base-url", server.url, *args, "--disable-tqdm")
    assert result["completed"] + result["failed"] == 20
    assert 0 < result["failed"] < 20
    errors = [e for e in result["errors"] if e]
    assert len(errors) == result["failed"] and all("HTTP 400" in e and "context" in e for e in errors)
    assert f"Failed requests:                         {result['failed']}" in stdout


def test_launch_server_starts_and_stops_it(tiny_model, tmp_path):
    server_args = f"--served-model-name launched --kv-cache-memory-bytes {KV_CACHE_BYTES} --max-model-len 512"
    result, _ = bench(tmp_path, tiny_model, "--launch-server", "--server-args", server_args, *SMALL, "--max-concurrency", "8")
    assert result["model_id"] == "launched"
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 64)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{result['base_url']}/health", timeout=2.0)


def test_bad_flags_say_what_to_do(capsys):
    from sonar.cli.main import main

    assert main(["bench", "serve", "--dataset-name", "sharegpt"]) == 1
    assert "--dataset-name sharegpt needs --dataset-path FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--percentile-metrics", "ttft,foo"])
    assert "choose from e2el,itl,tpot,ttft" in capsys.readouterr().err


def test_without_sonar_server_it_prints_the_install_hint():
    code = "import sys; sys.modules['sonar_server.bench_serve'] = None; from sonar.cli.main import main; sys.exit(main(['bench', 'serve']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "sonar bench serve needs the sonar-server package: pip install sonar-server" in done.stderr


def test_percentiles_and_goodput_arithmetic():
    assert percentile([], 99) == 0.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5  # between the middle two
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    outputs = [
        # ttft 0.1 s, e2el 0.5 s, 5 tokens: tpot (0.5 - 0.1) / 4 = 0.1 s
        RequestOutput(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        # ttft 0.3 s, e2el 0.6 s, 4 tokens: tpot 0.1 s
        RequestOutput(success=True, prompt_len=20, output_tokens=4, ttft=0.3, latency=0.6, itl=[0.05, 0.15, 0.1]),
        RequestOutput(success=False, prompt_len=30, error="HTTP 400: too long"),
    ]
    result = summarize(outputs, 2.0, ["ttft", "tpot", "itl"], [50, 99], {"ttft": 200, "tpot": 100})
    assert (result["completed"], result["failed"]) == (2, 1)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (30, 9)
    assert result["request_throughput"] == 1.0
    assert result["output_throughput"] == 4.5
    assert result["total_token_throughput"] == 19.5
    assert result["request_goodput"] == 0.5  # only the first meets ttft <= 200 ms
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["p99_ttft_ms"] == pytest.approx(298.0)
    assert result["mean_tpot_ms"] == pytest.approx(100.0)
    assert result["median_itl_ms"] == pytest.approx(100.0)
    assert result["p99_itl_ms"] == pytest.approx(150.0 - 0.06 * 50)  # 7 gaps: rank 5.94 between 100 and 150
    assert "mean_e2el_ms" not in result  # not asked for
    assert summarize(outputs, 2.0, ["ttft"], [99], {})["request_goodput"] is None
    assert math.isclose(summarize(outputs, 2.0, ["e2el"], [99], {"e2el": 550})["request_goodput"], 0.5)


# the streaming client against a scripted server

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
DONE = b"data: [DONE]\n\n"
CLOSE = None  # in a script: the server closes the connection there
PAUSE_S = 0.002


def event(data: dict, prefix: bytes = b"data: ", newline: bytes = b"\n") -> bytes:
    return prefix + json.dumps(data, ensure_ascii=False).encode() + newline + newline


def text_event(text: str, **options: bytes) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": None}]}, **options)


def usage_event(completion_tokens: int) -> bytes:
    return event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": completion_tokens}})


def chunked(body: bytes, cuts: list[int]) -> bytes:
    """``body`` in chunked coding, a chunk between consecutive ``cuts``, then the last chunk."""
    edges = [0, *cuts, len(body)]
    return b"".join(b"%x\r\n%s\r\n" % (end - start, body[start:end]) for start, end in itertools.pairwise(edges) if end > start) + END


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


class ScriptedServer:
    """Answers each request, on any connection, with the next script: raw bytes written apart (a
    pause after each, so the client reads them apart), a float to wait that long, ``CLOSE``."""

    def __init__(self, *scripts: list[bytes | float | None]) -> None:
        self.scripts = list(scripts)
        self.bodies: list[bytes] = []
        self.num_connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while self.scripts:
                head = await reader.readuntil(b"\r\n\r\n")
                self.bodies.append(await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))))
                for step in self.scripts.pop(0):
                    if step is CLOSE:
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                        continue
                    writer.write(step)
                    await writer.drain()
                    await asyncio.sleep(PAUSE_S)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test ended
        finally:
            writer.close()


@asynccontextmanager
async def scripted_server(*scripts: list[bytes | float | None], ssl_context: ssl.SSLContext | None = None):
    server = ScriptedServer(*scripts)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=ssl_context)
    scheme = "https" if ssl_context else "http"
    server.url = f"{scheme}://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    async with listener:
        yield server


def run(scenario) -> object:
    return asyncio.run(asyncio.wait_for(scenario(), 20))


async def send(client: StreamClient) -> RequestOutput:
    return await send_request(client, "/v1/completions", b'{"prompt": [1, 2]}', BenchRequest([1, 2], 2, 3))


# every way an OpenAI-compatible server may write its events: CRLF, "event:" lines, comments,
# "data:" without a space, blank lines, text of several bytes a character
SSE_BODY = (
    b": a comment\r\n\r\n"
    + b"event: completion\r\n"
    + text_event("h\u00e9llo", newline=b"\r\n")
    + text_event(" \u65e5\u672c\u8a9e", prefix=b"data:")
    + text_event(" \U0001f600!")
    + usage_event(3)
    + DONE
)
SSE_LINES = SSE_BODY.decode().splitlines()
# chunk boundaries inside a line, inside a CRLF and inside a 2-, 3- and 4-byte character
SSE_CUTS = [5, SSE_BODY.index(b"\r\n") + 1, SSE_BODY.index("\u00e9".encode()) + 1, SSE_BODY.index("\u65e5".encode()) + 2, SSE_BODY.index("\U0001f600".encode()) + 3]


@pytest.mark.parametrize("piece_size", [1, 7, 100000])
def test_stream_client_splits_chunked_sse_anywhere(piece_size):
    answer = pieces(CHUNKED_HEAD + chunked(SSE_BODY, SSE_CUTS), piece_size)

    async def scenario():
        async with scripted_server(answer, answer) as server, StreamClient(server.url) as client:
            async with client.post("/v1/completions", b"{}") as response:
                assert (response.status, response.headers["content-type"]) == (200, "text/event-stream")
                lines = [line.decode() async for line in response.lines()]
            output = await send(client)
            return lines, output, server.num_connections

    lines, output, num_connections = run(scenario)
    assert lines == SSE_LINES
    assert "data: {\"choices\": [{\"index\": 0, \"text\": \" \U0001f600!\", \"finish_reason\": null}]}" in lines
    assert (output.success, output.error, output.output_tokens, output.prompt_len, len(output.itl)) == (True, "", 3, 7, 2)
    assert num_connections == 1  # the first answer was read to its end: its connection served the second


def test_splitters_take_any_split_of_their_input():
    wire = chunked(SSE_BODY, SSE_CUTS)
    for cut in range(len(wire) + 1):
        decoder = ChunkedDecoder()
        body = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert (body, decoder.done) == (SSE_BODY, True)
    decoder = ChunkedDecoder()
    assert b"".join(decoder.feed(wire[i : i + 1]) for i in range(len(wire))) == SSE_BODY
    for cut in range(len(SSE_BODY) + 1):
        splitter = LineSplitter()
        lines = splitter.feed(SSE_BODY[:cut]) + splitter.feed(SSE_BODY[cut:])
        assert [line.decode() for line in lines] == SSE_LINES and splitter.rest == b""
    splitter = LineSplitter()
    assert splitter.feed(b"a\rb\r") + splitter.feed(b"\nc\n\r\n") == [b"a", b"b", b"c", b""]  # CR alone ends a line too


def test_stream_client_times_each_chunk():
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    deltas = [event({"choices": [{"index": 0, "delta": {"content": word}}]}) for word in ("one", " two", " three")]
    gap = 0.1
    answer = [CHUNKED_HEAD, gap, chunked(role, []).removesuffix(END)]
    for delta in deltas:
        answer += [gap, chunked(delta, []).removesuffix(END)]
    answer += [chunked(usage_event(3) + DONE, [])]

    async def scenario():
        async with scripted_server(answer) as server, StreamClient(server.url) as client:
            return await send(client)

    output = run(scenario)
    assert output.success and output.output_tokens == 3
    assert len(output.itl) == 2  # the role chunk carries no text: not a token
    assert 2 * gap <= output.ttft < 2 * gap + 1.0  # a pause never ends early; a busy machine may add to it
    assert all(gap / 2 <= itl < gap + 1.0 for itl in output.itl)
    assert output.latency >= output.ttft + sum(output.itl)


def test_stream_client_reads_content_length_and_close_delimited_bodies():
    body = text_event("a") + text_event("b")  # no usage: a token per chunk
    with_length = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body), *pieces(body, 9)]
    until_close = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", *pieces(body, 9), CLOSE]
    http_10 = [b"HTTP/1.0 200 OK\r\n\r\n", body + usage_event(2), CLOSE]

    async def scenario():
        async with scripted_server(with_length, until_close, http_10, with_length) as server, StreamClient(server.url) as client:
            outputs = [await send(client) for _ in range(4)]
            return outputs, server.num_connections

    outputs, num_connections = run(scenario)
    assert [(o.success, o.error, o.output_tokens, len(o.itl)) for o in outputs] == [(True, "", 2, 1)] * 4
    assert num_connections == 3  # kept after the Content-Length body, closed after the other two


def test_stream_client_reports_http_and_stream_errors():
    message = "This model's maximum context length is 512 tokens. However, you requested 600 tokens."
    error_json = json.dumps({"object": "error", "error": {"message": message, "type": "BadRequestError", "code": 400}}).encode()
    refused = [b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(error_json), error_json]
    not_found = [b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n", chunked(b'{"detail":"Not Found"}', [3])]
    failing = [CHUNKED_HEAD, chunked(text_event("a") + event({"error": {"message": "the engine stopped", "code": 500}}), [])]

    async def scenario():
        async with scripted_server(refused, not_found, failing) as server, StreamClient(server.url) as client:
            return [await send(client) for _ in range(3)]

    refused_output, not_found_output, failing_output = run(scenario)
    assert (refused_output.success, refused_output.error) == (False, f"HTTP 400: {message}")
    assert (not_found_output.success, not_found_output.error) == (False, 'HTTP 404: {"detail":"Not Found"}')
    assert (failing_output.success, failing_output.error) == (False, "stream error: the engine stopped")


def test_dropped_connections_and_timeouts_are_errors_not_hangs():
    dropped_mid_stream = [CHUNKED_HEAD, chunked(text_event("a"), []).removesuffix(END), CLOSE]
    dropped_before_answer = [CLOSE]
    stalled = [CHUNKED_HEAD, chunked(text_event("a"), []).removesuffix(END), 30.0]

    async def scenario():
        async with scripted_server(dropped_mid_stream, dropped_before_answer, stalled) as server, StreamClient(server.url, timeout=0.3) as client:
            outputs = [await send(client) for _ in range(2)]
            started = time.perf_counter()
            outputs.append(await send(client))
            return outputs, time.perf_counter() - started

    (mid_stream, before_answer, stalled_output), stalled_s = run(scenario)
    assert (mid_stream.success, mid_stream.error) == (False, "ConnectionError: the server closed the connection before the end of its answer")
    assert (before_answer.success, before_answer.error) == (False, "ConnectionError: the server closed the connection without answering")
    assert (stalled_output.success, stalled_output.error) == (False, "TimeoutError: no complete answer within 0.3 s")
    assert stalled_s < 5


def test_a_kept_connection_the_server_closed_is_replaced():
    answer = [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(usage_event(1) + DONE), usage_event(1) + DONE]

    async def scenario():
        # the server takes the second request on the kept connection and closes it unanswered
        async with scripted_server(answer, [CLOSE], answer) as server, StreamClient(server.url) as client:
            outputs = [await send(client) for _ in range(2)]
            return outputs, server.num_connections, len(server.bodies)

    outputs, num_connections, num_requests = run(scenario)
    assert [(o.success, o.output_tokens) for o in outputs] == [(True, 1), (True, 1)]
    assert (num_connections, num_requests) == (2, 3)


def test_stream_client_speaks_https(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    answer = [CHUNKED_HEAD, *pieces(chunked(SSE_BODY, SSE_CUTS), 50)]

    async def scenario():
        client_context = ssl.create_default_context(cafile=cert)
        async with scripted_server(answer, ssl_context=server_context) as server, StreamClient(server.url, ssl_context=client_context) as client:
            return server.url, await send(client)

    url, output = run(scenario)
    assert url.startswith("https://")
    assert (output.success, output.error, output.output_tokens, len(output.itl)) == (True, "", 3, 2)
