"""``sonar bench suite``: the GPU benchmark workloads in one run, one table.

Random bf16 weights (``load_format="dummy"``) for architecture configs written here (no
download), greedy with ``ignore_eos``, and transformers' ``generate()`` on the same
architecture measured in the same run as the peer.

- a. Qwen3-0.6B, 256 requests, input and output lengths uniform in [100, 1024], seed 0: output tok/s
- b. Llama-3.1-8B, 1,000 requests, 1,024 in / 128 out: output tok/s
- c. Llama-3.1-8B, 500 requests, 128 in / 2,048 out: output tok/s
- d. batch-1 decode time per output token, each model: the time of a 32-token prompt with
  ``short + N`` output tokens minus the time with ``short``, over ``N`` (prefill excluded)

The peer is far slower than the engine, so it runs a subset of each workload (fewer requests,
outputs capped) and its figure is per generated token of that subset; the table says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sonar.cli.bench import random_workload

QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
MODELS = {"Qwen3-0.6B": QWEN3_0_6B, "Llama-3.1-8B": LLAMA_3_1_8B}


@dataclass(slots=True)
class Spec:
    key: str
    model: str
    what: str
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    target: float
    floor: float | None
    unit: str  # "tok/s" (higher is better) or "ms/token" (lower is better)
    peer_prompts: int
    peer_max_output: int
    max_num_seqs: int = 256  # the engine's sequence cap for this workload


SPECS = [
    Spec("a", "Qwen3-0.6B", "256 req, in/out U[100,1024]", 256, (100, 1024), (100, 1024), 20000, 36000, "tok/s", 64, 64),
    # b: 1,000 requests of 1,024-token prompts: with 256 seats each step has room for only about
    # two new prompts, so steps stay small; 1,024 seats (vLLM's default on this class of GPU)
    # keep every step at the full token budget
    Spec("b", "Llama-3.1-8B", "1000 req, 1024 in / 128 out", 1000, (1024, 1024), (128, 128), 3800, 5400, "tok/s", 64, 32, 1024),
    Spec("c", "Llama-3.1-8B", "500 req, 128 in / 2048 out", 500, (128, 128), (2048, 2048), 12000, None, "tok/s", 64, 64),
    Spec("d", "Qwen3-0.6B", "batch 1, decode", 1, (32, 32), (256, 256), 2.0, 0.28, "ms/token", 1, 64),
    Spec("d", "Llama-3.1-8B", "batch 1, decode", 1, (32, 32), (256, 256), 4.5, 3.5, "ms/token", 1, 64),
]
MAX_MODEL_LEN = {"Qwen3-0.6B": 2176, "Llama-3.1-8B": 2304}
MAX_BATCHED_TOKENS = 8192  # prefill chunk per step: fewer, larger (eager) prefill steps
SHORT_DECODE = 8  # d: output tokens of the run whose time is subtracted


@dataclass(slots=True)
class Row:
    key: str
    model: str
    what: str
    unit: str
    target: float
    floor: float | None
    value: float | None = None
    peer: float | None = None
    peer_note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.unit == "tok/s" else self.value <= self.target


def add_suite_parser(kinds: argparse._SubParsersAction) -> None:
    suite = kinds.add_parser("suite", help="the GPU workloads a-d with transformers as the peer, one table")
    suite.add_argument("--workloads", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    suite.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests (quick runs)")
    suite.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="also run transformers' generate()")
    suite.add_argument("--profile", action="store_true", help="profile decode steps of each model at batch 256 and print where time goes")
    suite.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    suite.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step (default: each workload's)")
    suite.add_argument("--quantization", "-q", default=None, help="run the engine with this quantization method (fp8 quantizes the bf16 weights at load)")
    suite.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV-cache dtype (auto: the model's; fp8)")
    suite.add_argument("--speculative-config", default=None, help="JSON speculative_config for every workload's engine (vLLM's keys)")
    suite.add_argument("--output-json", default=None)
    suite.set_defaults(func=run_suite)


def _write_config(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODELS[name], indent=1))
    return folder


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync() -> None:
    from sonar.platform import current_platform

    current_platform().synchronize()


# -- the engine ---------------------------------------------------------------------------


def _engine(folder: Path, name: str, utilization: float, max_num_seqs: int, **options: Any):
    from sonar.entrypoints.llm import LLM

    return LLM(
        str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN[name], gpu_memory_utilization=utilization, enable_prefix_caching=False,
        max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=max_num_seqs, **options,
    )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the command line adds to every workload's engine."""
    options: dict[str, Any] = {}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.speculative_config:
        options["speculative_config"] = json.loads(args.speculative_config)
    return options


def _generate(llm, prompts: list[list[int]], output_lens: list[int], phases: dict[str, float] | None = None) -> tuple[float, int]:
    """Run the prompts; seconds and output tokens. ``phases`` (if given) receives what
    ``run_counters`` counts over the run."""
    from sonar.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in output_lens]
    with run_counters(llm.llm_engine, phases is not None) as counters:
        _sync()
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _sync()
        elapsed = time.perf_counter() - started
    if phases is not None:
        phases.update(counters)
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


@contextlib.contextmanager
def run_counters(engine: Any, phase_timing: bool = True) -> Iterator[dict[str, float]]:
    """Counts what a timed run of ``engine`` (an ``LLMEngine``) met; the dict yielded is
    filled when the block ends: the number of steps, the host's seconds in each part of a step
    (launch and its pieces, the wait for results, the scheduler, output processing, and a
    speculative runner's verification and drafting) where ``phase_timing``, the CUDA caching
    allocator's counters of host waits, and the number of Triton kernels compiled meanwhile
    (a timed run should compile none: a compile takes longer than hundreds of steps)."""
    counters: dict[str, float] = {}
    steps_before, memory_before, compiled_before = engine.get_stats().num_steps, _memory_stats(), _triton_cache_entries()
    with _phase_timing(engine, phase_timing) as totals:
        yield counters
    counters.update(totals)
    counters["steps"] = engine.get_stats().num_steps - steps_before
    counters.update({k: v - memory_before.get(k, 0) for k, v in _memory_stats().items()})
    counters["triton_compiles"] = _triton_cache_entries() - compiled_before


def per_step(counters: dict[str, float]) -> dict[str, float]:
    """``run_counters``' figures with each step part's host seconds as milliseconds per step."""
    steps = max(int(counters.get("steps", 0)), 1)
    return {k: (round(1000 * v / steps, 3) if isinstance(v, float) else v) for k, v in counters.items()}


@contextlib.contextmanager
def _phase_timing(engine: Any, enabled: bool = True) -> Iterator[dict[str, float]]:
    """While inside, the engine times the parts of its steps; the dict yielded holds the host
    seconds per part once the block ends."""
    totals: dict[str, float] = {}
    if enabled:
        engine.set_phase_timing(True)
    try:
        yield totals
    finally:
        if enabled:
            totals.update(engine.phase_times())
            engine.set_phase_timing(False)


def _triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (a new entry: a kernel compiled meanwhile)."""
    try:
        from triton import knobs

        return len(os.listdir(knobs.cache.dir))
    except (ImportError, OSError, AttributeError):
        return 0


def _memory_stats() -> dict[str, int]:
    """The CUDA caching allocator's counters that mean the host waited: retried allocations
    (cached blocks freed, which synchronises) and device-wide synchronisations."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_mallocs": stats.get("num_device_alloc", 0),
            "sync_all_streams": stats.get("num_sync_all_streams", 0)}


def _decode_ms_per_token(run_short, run_long, num_tokens: int, repeats: int = 3) -> float:
    """Best of ``repeats`` of (long - short) / num_tokens, in milliseconds."""
    best = float("inf")
    for _ in range(repeats):
        short, long = run_short(), run_long()
        best = min(best, (long - short) / num_tokens)
    return 1000 * best


def _run_engine_rows(llm, name: str, specs: list[Spec], scale: float, rows: dict[tuple[str, str], Row]) -> None:
    vocab = MODELS[name]["vocab_size"]
    # warm-up: short requests, then 16 of each workload's shape (other prompts than the timed
    # ones), so the timed runs meet no first-use costs (Triton compiles a kernel the first
    # time it sees a new specialisation)
    _generate(llm, random_workload(4, (8, 64), (8, 16), vocab, 1).prompts, [16] * 4)
    for spec in specs:
        if spec.key != "d":
            _generate(llm, random_workload(16, spec.input_len, spec.output_len, vocab, 1).prompts, [16] * 16)
    for spec in specs:
        row = rows[(spec.key, name)]
        if spec.key == "d":
            prompt = random_workload(1, spec.input_len, spec.input_len, vocab, 0).prompts
            extra = spec.output_len[0]
            row.value = _decode_ms_per_token(
                lambda: _generate(llm, prompt, [SHORT_DECODE])[0], lambda: _generate(llm, prompt, [SHORT_DECODE + extra])[0], extra
            )
            row.detail = {"prompt_tokens": spec.input_len[0], "decode_tokens_timed": extra}
        else:
            count = max(1, round(spec.num_prompts * scale))
            workload = random_workload(count, spec.input_len, spec.output_len, vocab, 0)
            phases: dict[str, float] = {}
            elapsed, num_output = _generate(llm, workload.prompts, workload.output_lens, phases)
            row.value = num_output / elapsed
            row.detail = {"requests": count, "elapsed_s": round(elapsed, 2), "output_tokens": num_output,
                          "prompt_tokens": workload.num_prompt_tokens,
                          "host_s": {key: round(value, 2) for key, value in phases.items()}}
            print(f"    {row.detail}", file=sys.stderr, flush=True)
        print(f"  {spec.key} {name}: {row.value:.2f} {spec.unit}", file=sys.stderr, flush=True)


# -- the peer -----------------------------------------------------------------------------


def _hf_model(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(MODELS[name])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval(), device


def _hf_generate(model, device: str, prompts: list[list[int]], new_tokens: int) -> float:
    """One left-padded batch, greedy, exactly ``new_tokens`` new tokens each; seconds."""
    import torch

    longest = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    _release()
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _run_peer_rows(name: str, specs: list[Spec], rows: dict[tuple[str, str], Row]) -> None:
    model, device = _hf_model(name)
    vocab = MODELS[name]["vocab_size"]
    _hf_generate(model, device, [[100, 200, 300]], 4)  # warm-up
    for spec in specs:
        row = rows[(spec.key, name)]
        if spec.key == "d":
            prompt = random_workload(1, spec.input_len, spec.input_len, vocab, 0).prompts
            n = spec.peer_max_output
            row.peer = _decode_ms_per_token(
                lambda: _hf_generate(model, device, prompt, SHORT_DECODE), lambda: _hf_generate(model, device, prompt, SHORT_DECODE + n), n, 1
            )
            row.peer_note = f"{n} decode tokens"
        else:
            workload = random_workload(spec.num_prompts, spec.input_len, spec.output_len, vocab, 0)
            prompts = workload.prompts[: spec.peer_prompts]
            new_tokens = min(spec.peer_max_output, max(workload.output_lens[: spec.peer_prompts]))
            elapsed = _hf_generate(model, device, prompts, new_tokens)
            row.peer = len(prompts) * new_tokens / elapsed
            row.peer_note = f"first {len(prompts)} req, {new_tokens} out each"
        print(f"  peer {spec.key} {name}: {row.peer:.2f} {spec.unit} ({row.peer_note})", file=sys.stderr, flush=True)
    model = None  # the peer's weights go before the next model loads
    _release()


# -- profile ------------------------------------------------------------------------------


def _profile_decode(llm, name: str, batch: int = 256, steps: int = 8, prompt_len: int = 512) -> dict[str, Any]:
    """Wall time of decode steps at ``batch`` (contexts of ``prompt_len`` tokens) against the
    GPU's busy time, and the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sonar.sampling_params import SamplingParams

    engine = llm.llm_engine
    vocab = MODELS[name]["vocab_size"]
    workload = random_workload(batch, (prompt_len, prompt_len), (1, 1), vocab, 5)
    params = SamplingParams(max_tokens=steps * 3 + 16, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt}, params)
    decoding: set[str] = set()  # requests that produced a token: their prompts are prefilled
    while len(decoding) < batch:
        decoding.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    for _ in range(3):
        engine.step()
    _sync()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    wall_ms = 1000 * (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    phases = _time_phases(engine, steps)
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True,
    )[:12]
    host = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    result = {
        "batch": batch,
        "context_tokens": prompt_len,
        "wall_ms_per_step": round(wall_ms, 3),
        "host_phases_ms_per_step": phases,
        "gpu_busy_ms_per_step": round(device_us / 1000 / steps, 3),
        "top_kernels_ms_per_step": {e.key[:90]: round(getattr(e, "self_device_time_total", 0.0) / 1000 / steps, 3) for e in top},
        "top_host_ms_per_step": {e.key[:90]: round(e.self_cpu_time_total / 1000 / steps, 3) for e in host},
    }
    engine.abort_request([f"profile-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return result


def _profile_prefill(llm, name: str, prompt_len: int = 1024) -> dict[str, Any]:
    """One full prefill step (``MAX_BATCHED_TOKENS`` prompt tokens): wall time, GPU busy time,
    the top kernels, and the matrix-product rate it implies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sonar.sampling_params import SamplingParams

    engine = llm.llm_engine
    config = MODELS[name]
    count = MAX_BATCHED_TOKENS // prompt_len
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def one_step(tag: str) -> float:
        for i, prompt in enumerate(random_workload(count, (prompt_len, prompt_len), (1, 1), config["vocab_size"], 7).prompts):
            engine.add_request(f"prefill-{tag}-{i}", {"prompt_token_ids": prompt}, params)
        _sync()
        started = time.perf_counter()
        engine.step()  # the whole prefill of every prompt
        _sync()
        elapsed = time.perf_counter() - started
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()
        return elapsed

    one_step("warm")
    wall = min(one_step(f"t{i}") for i in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step("prof")
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True)[:12]
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    kv = config["num_key_value_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    linear_flops = 2 * count * prompt_len * layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return {
        "tokens": count * prompt_len,
        "wall_ms": round(1000 * wall, 2),
        "linear_tflops_at_wall": round(linear_flops / wall / 1e12, 1),
        "top_kernels_ms": {e.key[:90]: round(getattr(e, "self_device_time_total", 0.0) / 1000, 3) for e in top},
    }


def _time_phases(engine: Any, steps: int) -> dict[str, float]:
    """Host time per step of each phase (timed by the engine), and the device-only timings its
    workers take (one decode-graph replay at the largest captured batch)."""
    with _phase_timing(engine) as totals:
        _sync()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        whole = time.perf_counter() - started
    totals["whole step"] = whole
    result = {label: round(1000 * seconds / steps, 3) for label, seconds in totals.items()}
    result.update(engine.device_benchmarks())
    return result


# -- the table ----------------------------------------------------------------------------


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if unit == "tok/s" else f"{value:.3f}"


def print_table(rows: list[Row]) -> None:
    header = f"{'':2} {'model':13} {'workload':28} {'unit':9} {'sonar':>9} {'target':>8} {'met':>4} {'peer':>9} {'floor':>7}  peer ran"
    print(header)
    print("-" * len(header))
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "no")
        print(f"{r.key:2} {r.model:13} {r.what:28} {r.unit:9} {_fmt(r.value, r.unit):>9} {_fmt(r.target, r.unit):>8} {met:>4} "
              f"{_fmt(r.peer, r.unit):>9} {_fmt(r.floor, r.unit):>7}  {r.peer_note}")


def run_suite(args: argparse.Namespace) -> int:
    import torch

    wanted = {w.strip() for w in args.workloads.split(",") if w.strip()}
    specs = [s for s in SPECS if s.key in wanted]
    rows = {(s.key, s.model): Row(s.key, s.model, s.what, s.unit, s.target, s.floor) for s in specs}
    profile_result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            model_specs = [s for s in specs if s.model == name]
            if not model_specs:
                continue
            folder = _write_config(Path(tmp), name)
            if args.peer:
                print(f"peer: transformers generate() on {name}...", file=sys.stderr, flush=True)
                _run_peer_rows(name, model_specs, rows)
            seats = sorted({args.max_num_seqs or s.max_num_seqs for s in model_specs})
            for index, max_num_seqs in enumerate(seats):
                group = [s for s in model_specs if (args.max_num_seqs or s.max_num_seqs) == max_num_seqs]
                print(f"sonar: {name}, max_num_seqs {max_num_seqs}...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                llm = _engine(folder, name, args.gpu_memory_utilization, max_num_seqs, **_engine_options(args))
                print(f"  engine ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
                _run_engine_rows(llm, name, group, args.scale, rows)
                if args.profile and index == 0:
                    profile_result[name] = _profile_decode(llm, name)
                    profile_result[name]["prefill_step"] = _profile_prefill(llm, name)
                    profile_result[name]["batch_1"] = _profile_decode(llm, name, batch=1)
                    print(json.dumps(profile_result[name], indent=1), file=sys.stderr, flush=True)
                del llm
                _release()
    ordered = list(rows.values())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    weights = f"bf16 random weights{', quantization ' + args.quantization if args.quantization else ''}"
    cache = f", KV cache {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    print(f"\nsonar bench suite on {device} ({weights}{cache}, greedy, ignore_eos; scale {args.scale})")
    print_table(ordered)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": device, "scale": args.scale, "options": _engine_options(args), "rows": [asdict(r) for r in ordered], "profile": profile_result}, f, indent=1)
    return 0

