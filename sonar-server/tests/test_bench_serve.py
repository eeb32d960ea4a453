"""``sonar bench serve`` against the shared tiny server and against one it launches: the
numbers it reports, its JSON result, failed requests counted, and the metric arithmetic."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import KV_CACHE_BYTES, sonar_command
from sonar_server.bench_serve import RequestOutput, percentile, summarize

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
    assert "use --dataset-name random" in capsys.readouterr().err
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
