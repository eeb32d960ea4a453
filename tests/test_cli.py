"""The CLI on the embedded default model, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

SONAR = [sys.executable, "-m", "sonar.cli.main"]


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "SONAR_PLATFORM": "cpu"}
    return subprocess.run(SONAR + args, input=stdin, capture_output=True, text=True, timeout=300, env=env)


def test_bad_arguments_fail_cleanly() -> None:
    result = _run(["generate", "/no/such/model", "--prompt", "x"])
    assert result.returncode != 0
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_throughput_compares_with_transformers(tiny_model_dir, tmp_path) -> None:
    import json

    path = tiny_model_dir("llama")
    report = tmp_path / "bench.json"
    result = _run([
        "bench", "throughput", str(path), "--dtype", "float32", "--num-prompts", "6", "--input-len", "4:40",
        "--output-len", "4:12", "--compare-hf", "--max-model-len", "128", "--output-json", str(report),
    ])
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert figures["num_prompts"] == 6 and figures["output_tokens"] >= 6 * 4
    assert figures["output_tokens_per_s"] > 0 and figures["transformers"]["output_tokens_per_s"] > 0
    assert "sonar / transformers throughput" in result.stdout


def test_bench_throughput_on_sharegpt_and_custom_files(tiny_model_dir, tmp_path) -> None:
    import json

    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    sharegpt = tmp_path / "sharegpt.json"
    conversations = [
        {"conversations": [{"from": "human", "value": "Name three rivers of Europe, please."}, {"from": "gpt", "value": "The Danube, the Rhine and the Loire."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there, how can I help?"}]},  # prompt too short: skipped
    ]
    sharegpt.write_text(json.dumps(conversations))
    report = tmp_path / "bench.json"
    common = ["--dtype", "float32", "--max-model-len", "128", "--num-prompts", "3", "--output-json", str(report)]
    result = _run(["bench", "throughput", str(path), "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), *common])
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    prompt = tokenizer.encode(conversations[0]["conversations"][0]["value"])
    reply = tokenizer.encode(conversations[0]["conversations"][1]["value"], add_special_tokens=False)
    assert (figures["prompt_tokens"], figures["output_tokens"]) == (3 * len(prompt), 3 * len(reply))  # the one usable pair, cycled
    custom = tmp_path / "prompts.jsonl"
    custom.write_text('{"turns": ["What is 2 + 2?", "And 3 + 3?"]}\n')
    result = _run(["bench", "throughput", str(path), "--dataset-name", "custom", "--dataset-path", str(custom), "--custom-output-len", "5", *common])
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert (figures["prompt_tokens"], figures["output_tokens"]) == (3 * len(tokenizer.encode("What is 2 + 2?")), 15)
    missing = _run(["bench", "throughput", str(path), "--dataset-name", "custom"])
    assert missing.returncode != 0 and "--dataset-name custom needs --dataset-path FILE" in missing.stderr


def test_bench_latency_separates_decode_from_prefill(tiny_model_dir, tmp_path) -> None:
    import json

    report = tmp_path / "latency.json"
    result = _run([
        "bench", "latency", str(tiny_model_dir("llama")), "--dtype", "float32", "--input-len", "16",
        "--output-len", "24", "--num-iters", "5", "--max-model-len", "128", "--output-json", str(report),
    ])
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert figures["total_s"] > figures["prefill_s"] > 0 and figures["decode_ms_per_step"] > 0
