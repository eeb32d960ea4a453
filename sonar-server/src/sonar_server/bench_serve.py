"""``sonar bench serve``: load a running server (or one it starts) with streaming requests and
report throughput and TTFT / TPOT / ITL / E2EL percentiles, with vLLM's ``bench serve`` flags.

Prompts are random but ordinary: token ids for /v1/completions are drawn from the server's
tokens of a list of common words (exact prompt lengths, no special or byte tokens); chat
prompts are random words of those, sized by the tokens per word the server reports. The
prompt tokens counted are the server's own, from each stream's usage.

The streams go through ``stream_client`` (under uvloop where it is installed), whose work per
request and per chunk is a small part of httpx's: the figures are the server's, not the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sonar_server.bench_datasets import DATASETS, dataset_requests
from sonar_server.bench_launch import LaunchedServer, free_port, healthy, wait_for
from sonar_server.settings import DEFAULT_PORT
from sonar_server.stream_client import StreamClient

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
PERCENTILE_METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)", "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
REQUEST_TIMEOUT_S = 6 * 3600.0

# the words random prompts are made of: common, mostly one token each in any BPE vocabulary
WORDS = """
the of and to in is was for on that with as by at from his her they this which be are
have had not but what all were when we there can an your more one would their said if do
will each about how up out them then she many some so these other into has two time
could no make than first been its who now people my made over did down only way find use
may water long little very after words called just where most know get through back much
before go good new write our used me man too any day same right look think also around
another came come work three word must because does part even place well such here take
why things help put years different away again off went old number great tell men say
small every found still between name should home big give air line set own under read last
never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until
form food keep children feet land side without boy once animals life enough took sometimes
four head above kind began almost live page got earth need far hand high year mother light
parts country father let night following picture being study second eyes soon times story
boys since white days ever paper hard near sentence better best across during today others
however sure means knew try told young miles sun ways thing whole hear example heard several
change answer room sea against top turned learn point city play toward five using himself
usually money seen car morning river open
""".split()


# workload


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int] | str  # token ids for /v1/completions, text for chat
    prompt_len: int  # the length asked for; the server's count comes back in usage
    output_len: int


@dataclass(slots=True)
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def random_lengths(rng: random.Random, length: int, range_ratio: float, count: int) -> list[int]:
    """``count`` lengths drawn uniformly from [length*(1-r), length*(1+r)], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_requests(args: argparse.Namespace, token_pool: list[int], tokens_per_word: float, chat: bool) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    input_lens = random_lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    output_lens = random_lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens):
        if chat:
            num_words = max(1, round(input_len / tokens_per_word))
            prompt: list[int] | str = " ".join(rng.choice(WORDS) for _ in range(num_words))
        else:
            prompt = [rng.choice(token_pool) for _ in range(input_len)]
        requests.append(BenchRequest(prompt, input_len, output_len))
    return requests


# metrics


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default); 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentile_name(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def metric_values(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests; ITL pools every request's gaps."""
    done = [o for o in outputs if o.success]
    return {
        "ttft": [o.ttft for o in done],
        "tpot": [o.tpot for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }


def is_good(output: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (milliseconds) of ``--goodput``."""
    measured = {"ttft": output.ttft, "tpot": output.tpot, "e2el": output.latency}
    return output.success and all(1000 * measured[key] <= limit for key, limit in slos_ms.items())


def summarize(
    outputs: list[RequestOutput], duration: float, metrics: list[str], percentiles: list[float], slos_ms: dict[str, float]
) -> dict[str, Any]:
    """The result's figures, under vLLM's keys."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": sum(is_good(o, slos_ms) for o in outputs) / duration if slos_ms else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    values = metric_values(outputs)
    for metric in metrics:
        ms = [1000 * v for v in values[metric]]
        result[f"mean_{metric}_ms"] = statistics.fmean(ms) if ms else 0.0
        result[f"median_{metric}_ms"] = percentile(ms, 50)
        result[f"std_{metric}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in percentiles:
            result[f"p{_percentile_name(p)}_{metric}_ms"] = percentile(ms, p)
    return result


def format_table(result: dict[str, Any], metrics: list[str], percentiles: list[float]) -> str:
    def row(label: str, value: Any) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {text:<10}"

    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", result["output_throughput"]), row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for metric in metrics:
        name = metric.upper()
        lines.append("{s:{c}^50}".format(s=PERCENTILE_METRICS[metric], c="-"))
        lines.append(row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"]))
        lines.append(row(f"Median {name} (ms):", result[f"median_{metric}_ms"]))
        for p in percentiles:
            key = _percentile_name(p)
            lines.append(row(f"P{key} {name} (ms):", result[f"p{key}_{metric}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


# one streaming request


def request_body(request: BenchRequest, model: str, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def encode_body(body: dict[str, Any]) -> bytes:
    """A request body as sent: compact JSON, encoded before the clock starts."""
    return json.dumps(body, separators=(",", ":")).encode()


class StreamReading:
    """One stream's figures as its SSE lines arrive: TTFT, the gap before each chunk that
    carries text, and the server's usage counts."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.num_chunks = 0
        self.started = self.last = time.perf_counter()

    def take(self, line: bytes) -> bool:
        """One line of the stream; False when it ends the stream (``[DONE]``, an error event)."""
        if not line.startswith(b"data:"):
            return True  # blank separators, comments, "event:" lines
        payload = line[5:].strip().decode()
        if payload == "[DONE]":
            return False
        data = json.loads(payload)
        if "error" in data:
            self.output.error = f"stream error: {_error_message(payload)}"
            return False
        now = time.perf_counter()
        if _chunk_text(data):
            if self.num_chunks == 0:
                self.output.ttft = now - self.started
            else:
                self.output.itl.append(now - self.last)
            self.num_chunks += 1
            self.last = now
        if usage := data.get("usage"):
            self.output.prompt_len = usage.get("prompt_tokens", self.output.prompt_len)
            self.output.output_tokens = usage.get("completion_tokens", 0)
        return True

    def finish(self) -> RequestOutput:
        """The output once the stream ended: a success unless an error event came."""
        output = self.output
        if output.error:
            return output
        output.latency = time.perf_counter() - self.started
        if not output.output_tokens:
            output.output_tokens = self.num_chunks  # a server without stream usage: one token per chunk
        output.success = True
        return output


async def send_request(client: StreamClient, path: str, body: bytes, request: BenchRequest) -> RequestOutput:
    """Stream one request; every failure becomes ``RequestOutput.error``, never an exception."""
    output = RequestOutput(prompt_len=request.prompt_len)
    try:
        reading = StreamReading(output)
        async with client.post(path, body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                output.error = f"HTTP {response.status}: {_error_message(text)}"
                return output
            async for line in response.lines():
                if not reading.take(line):
                    break
        return reading.finish()
    except Exception as exc:  # a failed request is counted, not fatal
        output.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return output


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text.strip()[:500]
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


# the benchmark


async def _arrivals(items: list[Any], rate: float, rng: random.Random):
    """``items`` at Poisson arrivals (exponential gaps of mean 1/rate); all at once for inf."""
    for number, item in enumerate(items):
        if number and rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
        yield item


async def benchmark(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> tuple[str, list[RequestOutput], float]:
    """The test request, the warm-ups, then every request timed: ``(model, outputs, seconds)``."""
    import httpx
    from tqdm import tqdm

    chat = args.endpoint == "/v1/chat/completions"
    # model and prompts
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)) as client:
        model = args.served_model_name or args.model or await _first_model(client, base_url)
        if args.dataset_name == "random":
            token_pool, tokens_per_word = await _server_tokens(client, base_url, model)
            requests = random_requests(args, token_pool, tokens_per_word, chat)
        else:
            requests = [BenchRequest(*row) for row in await dataset_requests(args, client, base_url, model)]
    bodies = [encode_body(request_body(r, model, chat, args.ignore_eos)) for r in requests]

    async with StreamClient(base_url, headers, timeout=REQUEST_TIMEOUT_S) as client:
        # test run and warm-ups
        print("Starting initial single prompt test run...", flush=True)
        test = await send_request(client, args.endpoint, bodies[0], requests[0])
        if not test.success:
            raise RuntimeError(f"the initial test request failed: {test.error}; check --model, --endpoint and the server's log")
        print("Initial test run completed. Starting main benchmark run...", flush=True)
        for number in range(args.num_warmups):
            await send_request(client, args.endpoint, bodies[number % len(bodies)], requests[number % len(requests)])
        print(f"Traffic request rate: {args.request_rate}", flush=True)
        print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)

        # measured run
        progress = tqdm(total=len(requests), disable=args.disable_tqdm)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(body: bytes, request: BenchRequest) -> RequestOutput:
            if semaphore is None:
                output = await send_request(client, args.endpoint, body, request)
            else:
                async with semaphore:
                    output = await send_request(client, args.endpoint, body, request)
            progress.update(1)
            return output

        started = time.perf_counter()
        arrivals = _arrivals(list(zip(bodies, requests)), args.request_rate, random.Random(args.seed + 1))
        tasks = [asyncio.create_task(one(body, request)) async for body, request in arrivals]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        progress.close()
    return model, list(outputs), duration


def _run_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """``coroutine`` under uvloop where it is installed (less of the client's own time per chunk)."""
    try:
        from uvloop import run
    except ImportError:
        return asyncio.run(coroutine)
    return run(coroutine)


def build_result(args: argparse.Namespace, base_url: str, model: str, outputs: list[RequestOutput], duration: float) -> dict[str, Any]:
    """The run's settings, its figures (``summarize``) and each request's error, or details."""
    slos = dict(args.goodput or [])
    info = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ENDPOINTS[args.endpoint],
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != math.inf else "inf",
        "max_concurrency": args.max_concurrency,
        "goodput": slos or None,
    }
    result = summarize(outputs, duration, args.percentile_metrics, args.metric_percentiles, slos)
    details = {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return {**info, **result, **(details if args.save_detailed else {"errors": details["errors"]})}


async def _first_model(client, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET {base_url}/v1/models answered {response.status_code}: {_error_message(response.text)}; pass --model NAME (or --api-key)")
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model NAME")
    return models[0]["id"]


async def _server_tokens(client, base_url: str, model: str) -> tuple[list[int], float]:
    """The server's distinct token ids for ``WORDS``, and its tokens per word."""
    body = {"model": model, "prompt": " ".join(WORDS), "add_special_tokens": False}
    response = await client.post(f"{base_url}/tokenize", json=body)
    if response.status_code != 200:
        message = _error_message(response.text)
        raise RuntimeError(f"POST {base_url}/tokenize (the random prompts use the server's tokenizer) answered {response.status_code}: {message}")
    tokens = response.json()["tokens"]
    return sorted(set(tokens)), len(tokens) / len(WORDS)


# command line


def _comma_list(allowed: set[str]):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(sorted(allowed))}")
        return names

    return parse


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated percentiles in (0, 100], e.g. 50,90,99")
    return values


def _slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if key not in GOODPUT_METRICS or limit < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_METRICS)}, e.g. ttft:200")
    return key, limit


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"--random-range-ratio must be in [0, 1), got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``bench serve`` flags, plus MODEL / --launch-server to start the server here."""
    server = parser.add_argument_group("server")
    server.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="model to serve with `sonar serve` when no server answers (or with --launch-server)")
    server.add_argument("--base-url", default=None, help="server URL, e.g. http://10.0.0.2:2242 (default: http://HOST:PORT)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=None, help=f"default {DEFAULT_PORT}; a free port when launching")
    server.add_argument("--endpoint", default=None, choices=sorted(ENDPOINTS), help="default /v1/completions")
    server.add_argument("--backend", default=None, choices=["openai", "openai-chat", "vllm"], help="vLLM's name for the API; openai-chat implies --endpoint /v1/chat/completions")
    server.add_argument("--model", default=None, help="model name sent in requests (default: the first id of GET /v1/models); with --launch-server and no MODEL, the model to serve")
    server.add_argument("--served-model-name", default=None, help="model name sent in requests, when --model is the path to serve")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--launch-server", action="store_true", help="start `sonar serve MODEL` on a free port, benchmark it, then stop it")
    server.add_argument("--server-args", default="", help='extra `sonar serve` arguments for --launch-server, e.g. "--max-num-seqs 64"')
    server.add_argument("--ready-check-timeout-sec", type=float, default=600.0, help="how long to wait for the server's /health")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS, help="random (token ids, or words for chat), sharegpt or custom (files of real text, --dataset-path)")
    data.add_argument("--dataset-path", default=None, help="the sharegpt JSON file, or the custom JSON-lines file ({\"prompt\": ...} a line)")
    data.add_argument("--sharegpt-output-len", type=_positive, default=None, help="output tokens of every sharegpt request (default: its reply's length)")
    data.add_argument("--custom-output-len", type=_positive, default=256, help="output tokens of every custom request")
    data.add_argument("--num-prompts", type=_positive, default=1000)
    data.add_argument("--random-input-len", type=_positive, default=1024)
    data.add_argument("--random-output-len", type=_positive, default=128)
    data.add_argument("--random-range-ratio", type=_ratio, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True, help="send ignore_eos so each output is exactly its length")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--max-concurrency", type=_positive, default=None, help="most requests in flight at once")
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests after the test request")

    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", type=_comma_list(set(PERCENTILE_METRICS)), default="ttft,tpot,itl", help="comma-separated of ttft,tpot,itl,e2el")
    report.add_argument("--metric-percentiles", type=_percentiles, default="99", help="comma-separated percentiles, e.g. 50,90,99")
    report.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="KEY:MS", help="SLOs in ms (ttft, tpot, e2el), e.g. ttft:200 tpot:50")
    report.add_argument("--save-result", action="store_true", help="write the result as JSON")
    report.add_argument("--save-detailed", action="store_true", help="also save per-request lengths, TTFTs and ITLs")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None)
    report.add_argument("--disable-tqdm", action="store_true")


def _check(args: argparse.Namespace) -> None:
    if args.dataset_name != "random" and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    chat = "/v1/chat/completions"
    if args.backend == "openai-chat" and args.endpoint not in (None, chat):
        raise ValueError(f"--backend openai-chat speaks {chat}; leave out --endpoint {args.endpoint}")
    args.endpoint = args.endpoint or (chat if args.backend == "openai-chat" else "/v1/completions")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf sends all at once), got {args.request_rate}")
    if args.base_url and args.launch_server:
        raise ValueError("--base-url names a running server; leave it out with --launch-server")


def _result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = Path(str(result["model_id"])).name or "model"
        name = f"sonar-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def run(args: argparse.Namespace) -> int:
    _check(args)
    launched: LaunchedServer | None = None
    base_url = (args.base_url or f"http://{args.host}:{args.port or DEFAULT_PORT}").rstrip("/")
    model_path = args.model_path or (args.model if args.launch_server else None)
    if args.launch_server and not model_path:
        raise ValueError("--launch-server needs a MODEL to serve: sonar bench serve MODEL --launch-server")
    try:
        # server
        if args.launch_server or (model_path and not healthy(base_url)):
            launched = LaunchedServer(model_path, args.port or free_port(), args.server_args)
            launched.wait_ready(args.ready_check_timeout_sec)
            base_url = launched.url
            if args.model == model_path:
                args.model = None  # the path served; its API name comes from /v1/models
        else:
            if model_path:
                print(f"a server answers {base_url}; benchmarking it (--launch-server starts {model_path} instead)", file=sys.stderr)
            wait_for(base_url, args.ready_check_timeout_sec)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model, outputs, duration = _run_loop(benchmark(args, base_url, headers))
    finally:
        if launched is not None:
            launched.stop()
    result = build_result(args, base_url, model, outputs, duration)
    print(format_table(result, args.percentile_metrics, args.metric_percentiles))
    for message, count in Counter(o.error for o in outputs if not o.success).most_common(5):
        print(f"{count} request(s) failed: {message}", file=sys.stderr)
    if args.save_result:
        path = _result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"saved the result to {path}", file=sys.stderr)
    return 0 if result["completed"] else 1
