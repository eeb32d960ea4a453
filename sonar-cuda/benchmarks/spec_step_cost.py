"""What a speculative step costs beyond the model: a tiny random target and a random DSpark
drafter, so the forward passes are cheap and the host's and the drafter's per-step work shows.

    python sonar-cuda/benchmarks/spec_step_cost.py [--batches 1,64] [--configs none,fixed,confidence,fixed-unchained]
        [--output-len 64] [--step-classes] [--output-json F] [--torch-profile DIR]

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
``--configs confidence``) more than once. Runs on a GPU, or on the CPU where there is none.
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


def build(root: Path) -> tuple[Path, Path]:
    """A 4-layer random Llama (hidden 64) and a random DSpark drafter for it (7-slot blocks)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    target = root / "target"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    hf = AutoConfig.from_pretrained(target)
    drafter_config = drafter_config_for(hf, "deepspec", 7, 2, [-1, 1, 2], VOCAB - 1, markov_rank=16, markov_head_type="vanilla", confidence_head=True)
    weights = load_file(str(target / "model.safetensors"))
    drafter = root / "drafter"
    save_dflash(init_drafter(DFlashDrafter(drafter_config), std=0.1, seed=0), drafter,
                embedding=weights["model.embed_tokens.weight"], lm_head=weights["lm_head.weight"])  # fmt: skip
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


def profile_steps(llm: LLM, prompts: list[dict], path: Path, num_steps: int = 4) -> None:
    """torch.profiler over ``num_steps`` steps in the middle of a run of ``prompts``: the host
    and device time of each operator (self time, sorted), written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    for _ in range(8):  # past the prefills
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


def sync_sites(llm: LLM, prompts: list[dict], path: Path, num_steps: int = 48) -> None:
    """Where the host waits for the device: ``num_steps`` steps in the middle of a run of
    ``prompts`` under torch's CUDA sync debug mode, each synchronizing call counted by its
    Python call stack (the innermost frames of Sonar's code), written to ``path``."""
    import collections
    import traceback
    import warnings

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True, detokenize=False)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--configs", default="none,fixed,confidence",
                        help="which engines, each measured in turn (run one per invocation for a fresh process each); "
                             "fixed-unchained, confidence-unchained: without drafts chained behind verification")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="output tokens per request in the timed runs")
    parser.add_argument("--step-classes", action="store_true", help="also time each step and report them by kind (plain, drafting, probe, verifying)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--torch-profile", default=None, metavar="DIR", help="also profile a few steps at each batch size (torch.profiler tables into DIR; on a GPU also where the host waits for it)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB - 1) for _ in range(32)]} for _ in range(max(batches))]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    warm_up = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp))
        for name in args.configs.split(","):
            verification, _, unchained = name.partition("-")
            spec = None if name == "none" else {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 7,
                                                 "verification": verification, "disable_by_batch_size": NO_BATCH_LIMIT}  # fmt: skip
            options = {"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}
            llm = LLM(str(target), max_model_len=512, max_num_seqs=max(batches), enable_prefix_caching=False,
                      speculative_config=spec, skip_tokenizer_init=True, **options)  # fmt: skip
            if unchained == "unchained":  # the drafter runs once each step's tokens are back, as before chaining
                llm.llm_engine.core.executor.worker.model_runner.spec.chain_drafts = False
            for batch in batches:
                llm.generate(prompts[:batch][::-1], warm_up, use_tqdm=False)  # this batch size's shapes, compiled untimed
                with run_counters(llm.llm_engine) as counters, step_classes(llm) if args.step_classes else contextlib.nullcontext({}) as kinds:
                    sync()
                    started = time.perf_counter()
                    outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
                    sync()
                    seconds = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                steps = max(int(counters["steps"]), 1)
                results.setdefault(name, {})[batch] = {
                    "tok_s": round(tokens / seconds, 1), "ms_per_step": round(1000 * seconds / steps, 3), "counters": per_step(counters),
                }  # fmt: skip
                if kinds:
                    results[name][batch]["steps_by_kind"] = {
                        kind: {"steps": len(times), "ms_mean": round(1000 * sum(times) / len(times), 3)} for kind, times in kinds.items()
                    }  # fmt: skip
                print(name, batch, results[name][batch], file=sys.stderr, flush=True)
                if args.torch_profile:
                    profile_steps(llm, prompts[:batch], Path(args.torch_profile) / f"{name}-{batch}.txt")
                    if torch.cuda.is_available():
                        sync_sites(llm, prompts[:batch], Path(args.torch_profile) / f"{name}-{batch}-syncs.txt")
            del llm
    line = json.dumps(results)
    print(line)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
