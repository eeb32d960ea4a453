"""What one API server process spends on a burst: its CPU seconds (from /proc) per burst of
streamed tokens, and the burst's output tok/s, over several bursts against one ``sonar serve``.

    python sonar-server/benchmarks/api_server_cpu.py --bursts 3
    python sonar-server/benchmarks/api_server_cpu.py --profile api.svg   # py-spy over one more burst

The model is a tiny random Llama (or ``--model``); the engine core is a separate process, so the
figure is the API server's own work: parsing, tokenizing, output processing, SSE encoding and
socket writes. Linux only (it reads ``/proc/PID/stat``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sonar_server.bench_launch import LaunchedServer

SERVE_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "512", "--max-num-batched-tokens", "65536", "--no-enable-prefix-caching"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def burst(url: str, args: argparse.Namespace, num_prompts: int, result_dir: str) -> dict:
    name = f"burst-{time.monotonic_ns()}.json"
    command = [
        sys.executable, "-m", "sonar.cli.main", "bench", "serve", "--base-url", url, "--num-prompts", str(num_prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--save-result", "--result-dir", result_dir, "--result-filename", name, "--disable-tqdm",
    ]
    subprocess.run(command, check=True, capture_output=True)
    return json.loads((Path(result_dir) / name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model to serve (default: a tiny random Llama)")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--serve-args", default="", help="extra `sonar serve` flags")
    parser.add_argument("--profile", default=None, metavar="FILE", help="after the bursts, py-spy record one more burst: a flame graph (.svg) or collapsed stacks (.txt)")
    args = parser.parse_args()

    folder = None
    model = args.model
    if model is None:
        from sonar_models.testing import build_tiny_model

        folder = tempfile.mkdtemp(prefix="sonar-api-cpu-")
        model = str(build_tiny_model("llama", Path(folder) / "llama"))
    os.environ.setdefault("SONAR_PLATFORM", "cpu")
    server = LaunchedServer(model, args.port, shlex.join([*SERVE_ARGS, *args.serve_args.split()]))
    url = server.url
    result_dir = tempfile.mkdtemp(prefix="sonar-api-cpu-results-")
    try:
        server.wait_ready(300.0)
        burst(url, args, 64, result_dir)  # warm-up
        for number in range(args.bursts):
            before = cpu_seconds(server.process.pid)
            result = burst(url, args, args.num_prompts, result_dir)
            spent = cpu_seconds(server.process.pid) - before
            tokens = result.get("total_output_tokens") or args.num_prompts * args.output_len
            print(f"burst {number + 1}: API server CPU {spent:.2f} s for {tokens} tokens ({spent / tokens * 1e6:.1f} us a token); "
                  f"output {result.get('output_throughput', 0.0):,.0f} tok/s", flush=True)
        if args.profile:
            spy_format = ["--format", "raw"] if args.profile.endswith(".txt") else []
            py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
            spy = subprocess.Popen([py_spy, "record", "-o", args.profile, "--pid", str(server.process.pid), "--rate", "200", "--gil", *spy_format],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            burst(url, args, args.num_prompts, result_dir)
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
            print(f"profile: {args.profile}")
    finally:
        server.stop()
        shutil.rmtree(result_dir, ignore_errors=True)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
