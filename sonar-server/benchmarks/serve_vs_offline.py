"""``sonar bench serve`` against ``sonar serve`` and ``sonar bench throughput|latency`` offline,
the same workloads in one run, on one model:

    python sonar-server/benchmarks/serve_vs_offline.py --model-name Llama-3.1-8B --out results/

1. N requests sent at once (default 500, 1,024 in / 128 out): server output tok/s against
   offline (``--api-server-count`` 1, and again with ``--four-api-servers``);
2. 32 concurrent streams, 512 in / 256 out: TPOT p50 and ITL p50/p99;
3. 1 stream, 128 in / 256 out: TPOT against offline batch-1 decode per step.

``--model-name`` takes a config of ``sonar bench suite`` (random bf16 weights,
``load_format=dummy``) and gives it a synthetic word-level tokenizer of the model's full
vocabulary, so the server tokenizes, detokenizes and streams every token for real; ``--model``
serves a real folder or .gguf file instead (the embedded model: ``--model default``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sonar_server.bench_launch import LaunchedServer, free_port

SONAR = [sys.executable, "-m", "sonar.cli.main"]


def write_dummy_model(root: Path, name: str) -> Path:
    """The suite's config of ``name`` plus a word-level tokenizer with one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sonar.cli.bench_suite import _write_config, MODELS
    from sonar_server.bench_serve import WORDS

    folder = _write_config(root, name)
    vocab: dict[str, int] = {}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    size = MODELS[name]["vocab_size"]
    while len(vocab) < size:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="the"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = MODELS[name]["eos_token_id"]
    eos_token = next(word for word, index in vocab.items() if index == eos)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, unk_token="the").save_pretrained(folder)
    return folder


def run(command: list[str], log: Path) -> None:
    print("$", shlex.join(command), flush=True)
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)


def bench_serve(url: str, out: Path, tag: str, log: Path, num_prompts: int, input_len: int, output_len: int, concurrency: int | None) -> dict:
    command = [
        *SONAR, "bench", "serve", "--base-url", url, "--num-prompts", str(num_prompts),
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out), "--result-filename", f"{tag}.json", "--disable-tqdm",
    ]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    run(command, log)
    return json.loads((out / f"{tag}.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-name", default=None, help="a sonar bench suite config: Llama-3.1-8B or Qwen3-0.6B")
    parser.add_argument("--model", default=None, help="a model folder or .gguf file ('default': the embedded model)")
    parser.add_argument("--engine-args", default="", help="engine flags for both sides")
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrent", default="32:512:256:128", help="STREAMS:IN:OUT:PROMPTS of the concurrent workload ('' skips it)")
    parser.add_argument("--single", default="128:256:8", help="IN:OUT:PROMPTS of the one-stream workload ('' skips it)")
    parser.add_argument("--api-server-counts", default="1", help="comma-separated --api-server-count values to serve with (the first workload runs on each)")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline runs (figures from an earlier run's summary.json in --out)")
    parser.add_argument("--out", default="serve-results")
    parser.add_argument("--summary-dir", default=None, help="also copy summary.json and log.txt here")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    engine_flags = shlex.split(args.engine_args)
    if args.model_name:
        model = str(write_dummy_model(Path(tempfile.mkdtemp()), args.model_name))
        engine_flags = ["--load-format", "dummy", *engine_flags]
    elif args.model and args.model != "default":
        model = args.model
    else:
        from sonar.config import default_model_path

        model = default_model_path()
    results: dict = {"model": args.model_name or model, "engine_args": engine_flags}

    if args.no_offline:
        earlier = json.loads((out / "summary.json").read_text())
        results.update({k: v for k, v in earlier.items() if k.startswith("offline")})
    # offline, the same shapes
    offline = out / "offline.json"
    if not args.no_offline:
        run([*SONAR, "bench", "throughput", model, *engine_flags, "--num-prompts", str(args.num_prompts),
             "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--output-json", str(offline)], log)
        results["offline_throughput"] = json.loads(offline.read_text())
    if args.single and not args.no_offline:
        single_in, single_out, _ = (int(x) for x in args.single.split(":"))
        latency = out / "offline_latency.json"
        run([*SONAR, "bench", "latency", model, *engine_flags, "--batch-size", "1", "--input-len", str(single_in),
             "--output-len", str(single_out), "--output-json", str(latency)], log)
        results["offline_latency"] = json.loads(latency.read_text())
    if args.concurrent:
        streams, conc_in, conc_out, conc_prompts = (int(x) for x in args.concurrent.split(":"))
    if args.concurrent and not args.no_offline:
        conc_offline = out / "offline_concurrent.json"
        run([*SONAR, "bench", "throughput", model, *engine_flags, "--num-prompts", str(conc_prompts), "--max-num-seqs", str(streams),
             "--input-len", str(conc_in), "--output-len", str(conc_out), "--output-json", str(conc_offline)], log)
        results["offline_concurrent"] = json.loads(conc_offline.read_text())

    for count in [int(c) for c in args.api_server_counts.split(",")]:
        server = LaunchedServer(model, free_port(), shlex.join([*engine_flags, "--api-server-count", str(count)]))
        try:
            server.wait_ready(900)
            tag = f"api{count}"
            bench_serve(server.url, out, f"{tag}_warmup", log, min(64, args.num_prompts), args.input_len, args.output_len, None)
            results[f"{tag}_burst"] = bench_serve(server.url, out, f"{tag}_burst", log, args.num_prompts, args.input_len, args.output_len, None)
            if count == 1 and args.concurrent:
                results[f"{tag}_concurrent"] = bench_serve(server.url, out, f"{tag}_concurrent", log, conc_prompts, conc_in, conc_out, streams)
            if count == 1 and args.single:
                single_in, single_out, single_prompts = (int(x) for x in args.single.split(":"))
                results[f"{tag}_single"] = bench_serve(server.url, out, f"{tag}_single", log, single_prompts, single_in, single_out, 1)
        finally:
            server.stop()

    summary = summarize(results)
    results["summary"] = summary
    name = "summary.json" if not args.no_offline else f"summary-api{args.api_server_counts.replace(',', '-')}.json"
    (out / name).write_text(json.dumps(results, indent=1))
    if args.summary_dir:
        import shutil

        Path(args.summary_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(out / name, Path(args.summary_dir) / name)
        shutil.copy(log, Path(args.summary_dir) / "log.txt")
    print(json.dumps(summary, indent=1))
    return 0


def summarize(results: dict) -> dict:
    summary: dict = {}
    offline = results["offline_throughput"]["output_tokens_per_s"]
    for key in ("api1_burst", "api4_burst"):
        if key in results:
            served = results[key]["output_throughput"]
            summary[key] = {"server_tok_s": round(served, 1), "offline_tok_s": offline, "ratio": round(served / offline, 3)}
    if "api1_concurrent" in results:
        r = results["api1_concurrent"]
        summary["concurrent"] = {
            "server_tok_s": round(r["output_throughput"], 1),
            "offline_tok_s": results["offline_concurrent"]["output_tokens_per_s"],
            "ratio": round(r["output_throughput"] / results["offline_concurrent"]["output_tokens_per_s"], 3),
            "tpot_p50_ms": round(r["p50_tpot_ms"], 3), "itl_p50_ms": round(r["p50_itl_ms"], 3), "itl_p99_ms": round(r["p99_itl_ms"], 3),
            "ttft_p50_ms": round(r["p50_ttft_ms"], 1),
        }
    if "api1_single" in results:
        r = results["api1_single"]
        decode = results["offline_latency"]["decode_ms_per_step"]
        summary["single"] = {"tpot_p50_ms": round(r["p50_tpot_ms"], 3), "tpot_mean_ms": round(r["mean_tpot_ms"], 3),
                             "offline_decode_ms": round(decode, 3), "ratio": round(r["p50_tpot_ms"] / decode, 3)}
    return summary


if __name__ == "__main__":
    sys.exit(main())
