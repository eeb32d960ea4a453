"""What a speculative step costs beyond the model: a tiny random target and a random DSpark
drafter, so the forward passes are cheap and the host's and the drafter's per-step work shows.

    python sonar-cuda/benchmarks/spec_step_cost.py [--batches 1,64] [--configs none,fixed,confidence,fixed-unchained,fixed-passes4]
        [--output-len 64] [--step-classes] [--output-json F] [--torch-profile DIR] [--target tiny|smollm2] [--turns N]

For each batch size: output tok/s and milliseconds per step with no speculation, and with
DSpark at 7 drafts a step under fixed-length verification (drafting at every batch size). A
random drafter's drafts are all rejected, so every speculative step emits one token per request
and verifies eight: its time per step is the whole cost of drafting and verifying. Then the
same drafter under confidence-scheduled verification, whose policy should learn that drafts
do not pay and stop drafting: its figure against no speculation is what the policy's probes
and bookkeeping cost. Each batch
size is warmed up first (its shapes compile untimed); each timed run reports its steps, the
host's milliseconds per step in each part of a step (``counters``: verification, the proposal and the host's
wait for it among them), the allocator's waits and the Triton kernels compiled meanwhile.
``--step-classes`` also times every step and reports them by kind (plain, drafting, probe,
verifying). A tiny target's step is host work, whose speed drifts over a process's life: to
compare two engines, run each in its own invocation (``--configs none``, then
``--configs confidence``) more than once, or keep them side by side and let them take turns
(``--turns N``: N rounds at each batch size, every engine once a round, the order rotated; the
report is each engine's median round and each round's ratio to the plain engine's).
``--target smollm2`` gives the target SmolLM2-135M's shape (30 layers, hidden 576, 49,152
tokens; random weights) and the drafter the shape `sonar train-drafter` gives it by default
(3 layers, Markov rank 256), so the device's share of a step is a real one. Runs on a GPU, or
on the CPU where there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import statistics

import torch
from safetensors.torch import load_file

from sonar import LLM, SamplingParams
from sonar.cli.bench_suite import per_step, run_counters
from sonar.spec_decode.dflash_checkpoint import save_dflash
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
from sonar.spec_decode.interface import NO_BATCH_LIMIT

VOCAB = 4096
OUTPUT_LEN = 64
PROMPT_LEN = 32
TARGETS = {  # name: (the target's Llama config fields, draft layers, target layers read, Markov rank)
    "tiny": (dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False), 2, [-1, 1, 2], 16),
    "smollm2": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=8192), 3, [1, 14, 27], 256),
}  # fmt: skip


def build(root: Path, shape: str = "tiny", keep_drafts: bool = False) -> tuple[Path, Path]:
    """A random Llama of ``TARGETS[shape]``'s shape (``tiny``: 4 layers, hidden 64) and a random
    DSpark drafter for it (7-slot blocks). ``keep_drafts``: the target's LM head (shared by the
    drafter) all zeros, so every token is token 0 and every draft is kept."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    fields, num_draft_layers, layer_ids, markov_rank = TARGETS[shape]
    target = root / "target"
    config = LlamaConfig(initializer_range=0.1, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if keep_drafts:
        with torch.no_grad():
            model.get_output_embeddings().weight.zero_()
    if shape != "tiny":  # as a real checkpoint of that size ships
        config.torch_dtype = torch.bfloat16
        model = model.to(torch.bfloat16)
    model.save_pretrained(target)
    hf = AutoConfig.from_pretrained(target)
    vocab = fields["vocab_size"]
    drafter_config = drafter_config_for(hf, "deepspec", 7, num_draft_layers, layer_ids, vocab - 1, markov_rank=markov_rank,
                                        markov_head_type="vanilla", confidence_head=True)  # fmt: skip
    weights = load_file(str(target / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    drafter = root / "drafter"
    save_dflash(init_drafter(DFlashDrafter(drafter_config), std=0.1, seed=0), drafter,
                embedding=embedding, lm_head=weights.get("lm_head.weight", embedding))  # fmt: skip
    return target, drafter


@contextlib.contextmanager
def step_classes(llm: LLM) -> Iterator[dict[str, list[float]]]:
    """Times each engine step while inside; the dict yielded holds, once the block ends, the
    seconds of each step by kind: ``plain`` (nothing drafted or verified), ``drafting`` (the
    proposer drafts for every request once the step's tokens are known), ``probe`` (for a
    few: ``draft_limit``), ``verifying`` (the step verifies drafts); a step may be several,
    joined by ``+``."""
    core = llm.llm_engine.core
    scheduler, step = core.scheduler, core.step
    speculative = bool(scheduler.config.spec_max_batch_size)
    schedule = scheduler.schedule
    latest: list[Any] = [None]
    kinds: dict[str, list[float]] = {}

    def schedule_and_keep():
        latest[0] = schedule()
        return latest[0]

    def timed_step():
        latest[0] = None
        started = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - started
        scheduled = latest[0]
        parts = []
        if speculative and scheduled is not None and scheduled.propose_drafts:
            parts.append("probe" if scheduled.draft_limit is not None else "drafting")
        if scheduled is not None and scheduled.scheduled_spec_decode_tokens:
            parts.append("verifying")
        kinds.setdefault("+".join(parts) or "plain", []).append(seconds)
        return outputs

    saved = [(obj, name, vars(obj).get(name)) for obj, name in ((scheduler, "schedule"), (core, "step"))]
    scheduler.schedule, core.step = schedule_and_keep, timed_step
    try:
        yield kinds
    finally:  # as it was: another wrapper's (a phase timer's), or none
        for obj, name, value in saved:
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(llm: LLM, prompts: list[dict], path: Path, num_steps: int = 4, output_len: int = OUTPUT_LEN) -> None:
    """torch.profiler over ``num_steps`` steps in the middle of a run of ``prompts``: the host
    and device time of each operator (self time, sorted), written to ``path``, and the steps'
    timeline beside it (``.json``, for chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    for _ in range(2 if len(prompts) == 1 else 8):  # past the prefills
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            engine.step()
        sync()
    while engine.has_unfinished_requests():
        engine.step()
    averages = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = [f"{num_steps} steps of {len(prompts)} requests\n", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if torch.cuda.is_available():
        sections.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
    path.write_text("\n".join(sections))
    prof.export_chrome_trace(str(path.with_suffix(".json")))


def sync_sites(llm: LLM, prompts: list[dict], path: Path, num_steps: int = 48, output_len: int = OUTPUT_LEN) -> None:
    """Where the host waits for the device: ``num_steps`` steps in the middle of a run of
    ``prompts`` under torch's CUDA sync debug mode, each synchronizing call counted by its
    Python call stack (the innermost frames of Sonar's code), written to ``path``."""
    import collections
    import traceback
    import warnings

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"sync-{i}", prompt, params)
    for _ in range(8):
        engine.step()
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "sonar" in f.filename and "warnings" not in f.filename]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(num_steps):
                engine.step()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished_requests():
        engine.step()
    lines = [f"{num_steps} steps of {len(prompts)} requests: {sum(sites.values())} synchronizing calls"]
    lines += [f"{count:6d}  {site}" for site, count in sites.most_common(40)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _engines(args: argparse.Namespace, target: Path, drafter: Path, max_batch: int) -> Iterator[tuple[str, LLM]]:
    """Each configuration's engine, built when asked for (``--turns``: all of them at once, each
    with the same KV-cache memory)."""
    for name in args.configs.split(","):
        verification, _, unchained = name.partition("-")
        spec = None if name == "none" else {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 7,
                                             "verification": verification, "disable_by_batch_size": NO_BATCH_LIMIT}  # fmt: skip
        if verification == "ngram":  # prompt lookup, 15 drafts (they find something only with --keep-drafts)
            spec = {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
        if unchained.startswith("passes"):  # fixed-passes4: up to 4 verify passes a step for a lone request
            spec["verify_passes"] = int(unchained.removeprefix("passes"))
        if args.turns:
            options = {"kv_cache_memory_bytes": 2 << 30}
        else:
            options = {"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}
        llm = LLM(str(target), max_model_len=512, max_num_seqs=max_batch, enable_prefix_caching=False,
                  speculative_config=spec, skip_tokenizer_init=True, **options)  # fmt: skip
        if unchained == "unchained":  # the drafter runs once each step's tokens are back, as before chaining
            llm.llm_engine.core.executor.worker.model_runner.spec.chain_drafts = False
        yield name, llm
        del llm  # one after another: gone before the next is built


def _timed_run(args: argparse.Namespace, llm: LLM, prompts: list[dict], phase_timing: bool = True) -> dict[str, Any]:
    """One timed run of ``prompts`` (``--output-len`` tokens each): tok/s, ms a step, the step's parts."""
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    with run_counters(llm.llm_engine, phase_timing) as counters, step_classes(llm) if args.step_classes else contextlib.nullcontext({}) as kinds:
        sync()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = max(int(counters["steps"]), 1)
    row = {"tok_s": round(tokens / seconds, 1), "ms_per_step": round(1000 * seconds / steps, 3), "counters": per_step(counters)}
    if kinds:
        row["steps_by_kind"] = {kind: {"steps": len(times), "ms_mean": round(1000 * sum(times) / len(times), 3)} for kind, times in kinds.items()}
    return row


def _warm_up(llm: LLM, prompts: list[dict]) -> None:
    """This batch size's shapes, compiled untimed."""
    llm.generate(prompts[::-1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)


def _one_after_another(args: argparse.Namespace, engines: Iterator[tuple[str, LLM]], batches: list[int], prompts: list[dict]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, llm in engines:
        for batch in batches:
            _warm_up(llm, prompts[:batch])
            results.setdefault(name, {})[batch] = _timed_run(args, llm, prompts[:batch])
            print(name, batch, results[name][batch], file=sys.stderr, flush=True)
            if args.torch_profile:
                profile_steps(llm, prompts[:batch], Path(args.torch_profile) / f"{name}-{batch}.txt", output_len=args.output_len)
                if torch.cuda.is_available():
                    sync_sites(llm, prompts[:batch], Path(args.torch_profile) / f"{name}-{batch}-syncs.txt",
                               num_steps=min(48, args.output_len // 8), output_len=args.output_len)
        del llm
    return results


def _in_turns(args: argparse.Namespace, engines: Iterator[tuple[str, LLM]], batches: list[int], prompts: list[dict]) -> dict[str, Any]:
    """``--turns`` rounds per batch size, every engine once a round, the order rotated: each
    engine's median round (its step parts from its last round) and each round's ratio of
    output tok/s to the plain engine's (``none``, where configured)."""
    built = dict(engines)
    names = list(built)
    results: dict[str, Any] = {}
    for batch in batches:
        for llm in built.values():
            _warm_up(llm, prompts[:batch])
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for index in range(args.turns):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                rounds[name].append(_timed_run(args, built[name], prompts[:batch], phase_timing=index == args.turns - 1))
            print(batch, {name: runs[-1]["tok_s"] for name, runs in rounds.items()}, file=sys.stderr, flush=True)
        for name, runs in rounds.items():
            rates = [run["tok_s"] for run in runs]
            row = {"tok_s": statistics.median(rates), "tok_s_by_round": rates, "counters": runs[-1]["counters"]}
            if "steps_by_kind" in runs[-1]:
                row["steps_by_kind"] = runs[-1]["steps_by_kind"]
            if "none" in rounds and name != "none":
                ratios = [round(a / b["tok_s"], 3) for a, b in zip(rates, rounds["none"])]
                row["ratio_by_round"], row["ratio"] = ratios, statistics.median(ratios)
            results.setdefault(name, {})[batch] = row
            print(name, batch, row, file=sys.stderr, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--configs", default="none,fixed,confidence",
                        help="which engines, each measured in turn (run one per invocation for a fresh process each); "
                             "fixed-unchained, confidence-unchained: without drafts chained behind verification; "
                             "fixed-passesN: up to N verify passes a step at batch 1 (queued on the device); "
                         "ngram, ngram-passesN: prompt lookup instead of the drafter (15 drafts)")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="output tokens per request in the timed runs")
    parser.add_argument("--step-classes", action="store_true", help="also time each step and report them by kind (plain, drafting, probe, verifying)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--torch-profile", default=None, metavar="DIR", help="also profile a few steps at each batch size (torch.profiler tables into DIR; on a GPU also where the host waits for it)")
    parser.add_argument("--target", default="tiny", choices=sorted(TARGETS), help="the target's shape (smollm2: SmolLM2-135M's, random weights)")
    parser.add_argument("--keep-drafts", action="store_true", help="the target's LM head all zeros: every token is 0 and every draft is kept (a pass's whole cost with full blocks)")
    parser.add_argument("--turns", type=int, default=0, help="keep the engines side by side and run them in turns, this many rounds per batch size")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    vocab = TARGETS[args.target][0]["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(vocab - 1) for _ in range(PROMPT_LEN)]} for _ in range(max(batches))]
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp), args.target, args.keep_drafts)
        engines = _engines(args, target, drafter, max(batches))
        results = _in_turns(args, engines, batches, prompts) if args.turns else _one_after_another(args, engines, batches, prompts)
    line = json.dumps(results)
    print(line)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
