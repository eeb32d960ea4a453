"""Prefill/decode disaggregation against one colocated server, and the host offload tier's TTFT,
on one GPU:

    python sonar-server/benchmarks/disaggregation.py --out results/disagg    # H200, 8B dummy
    python sonar-server/benchmarks/disaggregation.py --tiny                  # CPU smoke check

1. **Mixed load**: many short, decode-heavy streamed requests (default 128, 64 in / 256 out)
   with a few long prompts (default 8, 4,096 in / 16 out) arriving among them, sent to
   (a) one colocated ``sonar serve`` with ``--colocated-memory`` of the GPU, and (b) a prefill
   server and a decode server (``--split-memory`` of the GPU each, the same GPU; the decode
   server, started second, is given twice that as ``--gpu-memory-utilization`` since the
   fraction counts the memory the prefill server already holds) behind ``sonar proxy``. Reported: decode inter-token latency p50/p99 of the short requests and total
   throughput (prompt + generated tokens per second of wall time), and the ratios b/a.
2. **Host offload**: one server with ``--kv-offload-bytes`` and a device KV budget
   (``--offload-device-kv-bytes``) that holds one long request but not two; a 6,000-token
   prefix is sent (TTFT: computed), then two requests of other 6,000 tokens each evict it from
   the device, then the prefix again with another suffix (TTFT: loaded from host memory, checked on
   ``/metrics``), sent at once and, in alternate rounds, after ``--offload-pause`` seconds of
   idle time (by then the last evicting request's blocks have reached the host). Repeated
   ``--offload-rounds`` times each with fresh prefixes; medians reported.

``--connector`` picks the disaggregated run's KV connector: ``SonarConnector`` (built in) or
``NixlConnector`` (``pip install --no-deps nixl-cu12``); measure the other with ``--skip
colocated,offload --connector NixlConnector --out results/disagg-nixl``.

The 8B runs use ``Llama-3.1-8B`` from ``sonar bench suite`` with random weights
(``--load-format dummy``) and a word-level tokenizer of its full vocabulary; prompts are sent
as token ids, with ``ignore_eos`` so every request generates its full length. ``--tiny`` serves
a one-layer tiny Llama on the CPU with small sizes: it only shows the script runs end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_offline import write_dummy_model  # noqa: E402

from sonar_server.bench_launch import LaunchedServer, free_port, healthy  # noqa: E402

SONAR = [sys.executable, "-m", "sonar.cli.main"]
CONNECTORS = ("SonarConnector", "NixlConnector")


def transfer_config(connector: str, role: str, extra: dict) -> str:
    """The ``--kv-transfer-config`` of a prefill (``kv_producer``) or decode (``kv_consumer``) server."""
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra})


@dataclass
class Sizes:
    long_prompts: int
    long_len: int
    long_out: int
    short_prompts: int
    short_len: int
    short_out: int
    concurrency: int
    prefix_len: int
    max_model_len: int


FULL = Sizes(8, 4096, 16, 128, 64, 256, 64, 6000, 8192)
TINY = Sizes(2, 1024, 4, 8, 32, 16, 8, 2000, 2200)


@dataclass
class Result:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> Result:
    """One streamed completion of token ids: TTFT, the gaps between its tokens, its usage."""
    body = {
        "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    result = Result()
    start = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if event.get("usage"):
                result.prompt_tokens = event["usage"]["prompt_tokens"]
                result.completion_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0]["text"]:
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    return result


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(100, 20000) for _ in range(length)]


async def mixed_load(url: str, sizes: Sizes, seed: int) -> dict:
    """The short requests at ``concurrency`` at a time, the long ones spread over the run."""
    rng = random.Random(seed)
    shorts = [random_ids(rng, sizes.short_len) for _ in range(sizes.short_prompts)]
    longs = [random_ids(rng, sizes.long_len) for _ in range(sizes.long_prompts)]
    limit = asyncio.Semaphore(sizes.concurrency)
    timeout = httpx.Timeout(1800.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=sizes.concurrency + sizes.long_prompts + 8)) as client:

        async def short(prompt: list[int]) -> Result:
            async with limit:
                return await stream_completion(client, url, prompt, sizes.short_out)

        async def long(index: int, prompt: list[int]) -> Result:
            await asyncio.sleep(0.5 + index * 1.0)  # among the decodes, not all at once
            return await stream_completion(client, url, prompt, sizes.long_out)

        start = time.perf_counter()
        results = await asyncio.gather(*[short(p) for p in shorts], *[long(i, p) for i, p in enumerate(longs)])
        wall = time.perf_counter() - start
    short_results = results[: len(shorts)]
    itls = sorted(itl for r in short_results for itl in r.itls)
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in results)
    generated = sum(r.completion_tokens for r in results)
    return {
        "wall_s": round(wall, 3),
        "decode_itl_p50_ms": round(1000 * percentile(itls, 50), 3),
        "decode_itl_p99_ms": round(1000 * percentile(itls, 99), 3),
        "total_tokens_per_s": round(tokens / wall, 1),
        "output_tokens_per_s": round(generated / wall, 1),
        "long_ttft_p50_ms": round(1000 * statistics.median(r.ttft for r in results[len(shorts):] if r.ttft is not None), 1),
    }


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    rank = min(len(values) - 1, max(0, round(pct / 100 * (len(values) - 1))))
    return values[rank]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rpartition(" ")[2])
    return total


async def offload_ttft(url: str, sizes: Sizes, rounds: int, seed: int, pause_s: float) -> dict:
    """TTFT of a long prefix computed, and of the same prefix loaded back from host memory:
    sent the moment the evicting requests end (the last one's blocks are still being copied to
    the host, and the hit waits for that copy before its blocks are reused), and again after
    ``pause_s`` of idle time, as a user's next turn comes."""
    rng = random.Random(seed + 1)
    computed: list[float] = []
    loaded: dict[float, list[float]] = {0.0: [], pause_s: []}
    hits: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0)) as client:
        await stream_completion(client, url, random_ids(rng, 32), 2)  # warm up
        for _ in range(rounds):
            for pause in (0.0, pause_s):
                prefix = random_ids(rng, sizes.prefix_len)
                first = await stream_completion(client, url, prefix + random_ids(rng, 8), 1)
                for _ in range(2):  # other long prompts: together more than the device cache holds, so the prefix leaves it
                    await stream_completion(client, url, random_ids(rng, sizes.prefix_len), 1)
                await asyncio.sleep(pause)
                before = metric(url, "sonar:external_prefix_cache_hits_total")
                again = await stream_completion(client, url, prefix + random_ids(rng, 8), 1)
                hits.append(metric(url, "sonar:external_prefix_cache_hits_total") - before)
                computed.append(first.ttft)
                loaded[pause].append(again.ttft)
    ttft_computed = statistics.median(computed)
    at_once, later = statistics.median(loaded[0.0]), statistics.median(loaded[pause_s])
    return {
        "prefix_tokens": sizes.prefix_len,
        "ttft_computed_ms": round(1000 * ttft_computed, 2),
        "ttft_host_hit_ms": round(1000 * at_once, 2),
        "speedup": round(ttft_computed / at_once, 2),
        "pause_s": pause_s,
        "ttft_host_hit_after_pause_ms": round(1000 * later, 2),
        "speedup_after_pause": round(ttft_computed / later, 2),
        "host_hit_tokens_per_round": hits,
    }


class Proxy:
    def __init__(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        handle, log_path = tempfile.mkstemp(prefix="sonar-bench-proxy-", suffix=".log")
        os.close(handle)
        self.log_path = Path(log_path)
        command = [*SONAR, "proxy", "--prefill", prefill, "--decode", decode, "--port", str(self.port)]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not healthy(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sonar proxy did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def start(model: str, flags: list[str]) -> LaunchedServer:
    return LaunchedServer(model, free_port(), shlex.join(flags))


def stop_all(servers: list) -> None:
    for server in servers:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny one-layer model on the CPU, small sizes: a smoke check")
    parser.add_argument("--model-name", default="Llama-3.1-8B", help="a sonar bench suite config, served with dummy weights")
    parser.add_argument("--colocated-memory", type=float, default=0.8, help="--gpu-memory-utilization of the colocated server")
    parser.add_argument("--split-memory", type=float, default=0.4, help="--gpu-memory-utilization of the prefill and of the decode server")
    parser.add_argument("--offload-bytes", default="16GiB", help="--kv-offload-bytes of the offload run")
    parser.add_argument("--offload-device-kv-bytes", default="1GiB", help="--kv-cache-memory-bytes of the offload run: one long request fits, two do not (8B: 128 KiB a token)")
    parser.add_argument("--offload-rounds", type=int, default=3)
    parser.add_argument("--offload-pause", type=float, default=0.5, help="seconds of idle time before the second kind of repeat")
    parser.add_argument("--engine-args", default="", help="more engine flags for every server")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: colocated, disaggregated, offload")
    parser.add_argument("--connector", choices=CONNECTORS, default="SonarConnector", help="the KV connector of the disaggregated run (NixlConnector: needs nixl installed)")
    parser.add_argument("--connector-extra", default="{}", help="the connector's kv_connector_extra_config, as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="disaggregation-results")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.tiny:
        from sonar_models.testing import build_tiny_model

        sizes = TINY
        model = str(build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="sonar-bench-tiny-")), num_hidden_layers=1, max_position_embeddings=8192))
        base = ["--max-model-len", str(sizes.max_model_len), "--kv-cache-memory-bytes", str(64 << 20)]
        colocated_flags = split_flags = decode_flags = base
        offload_flags = ["--max-model-len", str(sizes.max_model_len), "--kv-cache-memory-bytes", str(140 * 4096), "--kv-offload-bytes", str(200 * 4096)]
    else:
        sizes = FULL
        model = str(write_dummy_model(Path(tempfile.mkdtemp()), args.model_name))
        base = ["--load-format", "dummy", "--max-model-len", str(sizes.max_model_len)]
        colocated_flags = [*base, "--gpu-memory-utilization", str(args.colocated_memory)]
        # utilization counts every process's memory on the device: the decode server, started
        # once the prefill server holds its share, asks for both shares to get its own
        split_flags = [*base, "--gpu-memory-utilization", str(args.split_memory)]
        decode_flags = [*base, "--gpu-memory-utilization", str(min(1.0, 2 * args.split_memory))]
        offload_flags = [*base, "--kv-cache-memory-bytes", args.offload_device_kv_bytes, "--kv-offload-bytes", args.offload_bytes]
    extra = shlex.split(args.engine_args)
    common = ["--served-model-name", "bench", *extra]
    results: dict = {"model": "tiny" if args.tiny else args.model_name, "sizes": sizes.__dict__, "connector": args.connector}
    connector_extra = json.loads(args.connector_extra)
    ready = 300 if args.tiny else 1800

    if "colocated" not in skip:
        server = start(model, [*colocated_flags, *common])
        try:
            server.wait_ready(ready)
            asyncio.run(mixed_load(server.url, Sizes(**{**sizes.__dict__, "long_prompts": 1, "short_prompts": 2}), args.seed + 99))  # warm up
            results["colocated"] = asyncio.run(mixed_load(server.url, sizes, args.seed))
        finally:
            stop_all([server])
        print("colocated:", json.dumps(results["colocated"]), flush=True)

    if "disaggregated" not in skip:
        # started one after the other, so that each sizes its KV cache with the other's memory known
        prefill = start(model, [*split_flags, *common, "--kv-transfer-config", transfer_config(args.connector, "kv_producer", connector_extra)])
        servers: list = [prefill]
        try:
            prefill.wait_ready(ready)
            decode = start(model, [*decode_flags, *common, "--kv-transfer-config", transfer_config(args.connector, "kv_consumer", connector_extra)])
            servers.append(decode)
            decode.wait_ready(ready)
            proxy = Proxy(prefill.url, decode.url)
            servers.append(proxy)
            proxy.wait_ready(120)
            asyncio.run(mixed_load(proxy.url, Sizes(**{**sizes.__dict__, "long_prompts": 1, "short_prompts": 2}), args.seed + 99))
            results["disaggregated"] = asyncio.run(mixed_load(proxy.url, sizes, args.seed))
            results["disaggregated"]["decode_server_transfer_failures"] = metric(decode.url, "sonar:kv_transfer_failures_total")
            results["disaggregated"]["decode_server_external_hits"] = metric(decode.url, "sonar:external_prefix_cache_hits_total")
        finally:
            stop_all(reversed(servers))
        print("disaggregated:", json.dumps(results["disaggregated"]), flush=True)

    if "colocated" in results and "disaggregated" in results:
        a, b = results["colocated"], results["disaggregated"]
        results["itl_p99_ratio"] = round(b["decode_itl_p99_ms"] / a["decode_itl_p99_ms"], 3)
        results["throughput_ratio"] = round(b["total_tokens_per_s"] / a["total_tokens_per_s"], 3)

    if "offload" not in skip:
        server = start(model, [*offload_flags, *common])
        try:
            server.wait_ready(ready)
            results["offload"] = asyncio.run(offload_ttft(server.url, sizes, 1 if args.tiny else args.offload_rounds, args.seed, args.offload_pause))
        finally:
            stop_all([server])
        print("offload:", json.dumps(results["offload"]), flush=True)

    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "sizes"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
