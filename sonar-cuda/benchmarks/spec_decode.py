"""Speculative decoding on one GPU: what a verify step costs, and what speculation gives.

    # the cost of verifying k drafts (k = 0..8) at several batch sizes, Llama-3.1-8B dummy bf16
    python sonar-cuda/benchmarks/spec_decode.py --part verify-cost --output-json verify.json
    # a loaded engine (batch 128) with speculation configured against without
    python sonar-cuda/benchmarks/spec_decode.py --part loaded
    # n-gram on code edits, and an EAGLE-3 head on chat prompts, with a real target (GGUF)
    python sonar-cuda/benchmarks/spec_decode.py --part ngram --target model.gguf --prompts mbpp.jsonl --ngram-configs 5:2:4,8:1:4
    # the same with three verify passes a step (a fourth field: speculative_config's verify_passes;
    # a fifth, "ops": the work between passes as separate device operations, not one launch)
    python sonar-cuda/benchmarks/spec_decode.py --part ngram --target model.gguf --prompts mbpp.jsonl --ngram-configs 15:1:4,15:1:4:3,15:1:4:3:ops
    python sonar-cuda/benchmarks/spec_decode.py --part eagle3 --target model.gguf --drafter head/ --prompts mt-bench.jsonl
    python sonar-cuda/benchmarks/spec_decode.py --part dspark --target model.gguf --drafter dspark/ --prompts mt-bench.jsonl -k 7
    # several drafters on the same prompts beside one plain run (fixed-length verification for
    # each, so their acceptance lengths compare; DSpark also with confidence-scheduled)
    python sonar-cuda/benchmarks/spec_decode.py --part drafters --target model.gguf --prompts gsm8k.jsonl --skip-prompts 1219 -k 7 \
        --drafters eagle3=head/,dflash=dflash/,dspark=dspark/
    # confidence-scheduled verification: the profiled cost curve, the drafts verified at batch
    # 1/64/256, throughput with fixed against confidence verification, a DSpark drafter's cost
    # (spec_confidence.py; --tiny runs it on the CPU)
    python sonar-cuda/benchmarks/spec_decode.py --part confidence --output-json confidence.json
    # a real target and a trained drafter at batch 1/64/256: none, fixed and confidence verification
    python sonar-cuda/benchmarks/spec_decode.py --part batched --method dspark --target model.gguf --drafter dspark/ --prompts gsm8k.jsonl --skip-prompts 1219 --num-prompts 100 -k 7

verify-cost drafts random tokens (a benchmark-only proposer): a random-weight target accepts
none of them, so every step emits one token per request while verifying k + 1 positions; its
time per step is the verify step's cost, and the speedup an acceptance length L would give
is ``L * cost(0) / cost(k)``.

The parts with a real target (ngram, eagle3, dflash, dspark, drafters, batched) keep their
engines side by side, each with ``--kv-cache-gib`` of KV cache, and have them take turns
(conversation by conversation at batch 1, run by run in ``batched``), the order rotated, for
``--rounds`` rounds: each figure is a median, each speedup the median of the rounds' ratios to
the plain engine's same round. A small target's step is mostly host work, and the host's speed
drifts over a process's life; engines run one after another would inherit that drift.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import spec_confidence  # beside this file (the script's folder is on sys.path)

from sonar import LLM, SamplingParams, registry
from sonar.cli.bench_suite import per_step, run_counters
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.spec_decode import DraftTokens, Proposer, ProposerInputs
from sonar.spec_decode.interface import NO_BATCH_LIMIT

MAX_K = 8
WARM_UP_TOKENS = 16  # output tokens of the warm-up run at each measured batch size


class RandomDrafts(Proposer):
    """Proposes ``RandomDrafts.k`` random tokens per request (set between runs)."""

    k = 0
    vocab = 1000

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        rng = random.Random(len(inputs.req_ids))
        return DraftTokens(inputs.req_ids, [[rng.randrange(self.vocab) for _ in range(self.k)] for _ in inputs.req_ids])


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("random-drafts", RandomDrafts)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    gc.collect()
    _sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _llama(root: Path) -> tuple[str, int]:
    from sonar.cli.bench_suite import MODELS, _write_config

    return str(_write_config(root, "Llama-3.1-8B")), MODELS["Llama-3.1-8B"]["vocab_size"]


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    _sync()
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    return time.perf_counter() - started


def _step_ms(llm: LLM, prompts: list[list[int]], steps: int = 32, base: int = 8) -> float:
    """Milliseconds per decode step: (time of base + steps tokens - time of base) / steps."""
    best = float("inf")
    for _ in range(2):
        short, long = _timed(llm, prompts, base), _timed(llm, prompts, base + steps)
        best = min(best, (long - short) / steps)
    return 1000 * best


def verify_cost(args: argparse.Namespace) -> dict[str, Any]:
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="bench-random-drafts")
    registry.clear_caches()
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {"batches": batches, "ms_per_step": {}, "plain_async_ms_per_step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder, vocab = _llama(Path(tmp))
        RandomDrafts.vocab = vocab
        common = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
                      gpu_memory_utilization=0.85, enable_prefix_caching=False, max_num_seqs=max(batches))
        rng = random.Random(0)
        prompts = {b: [[rng.randrange(vocab) for _ in range(128)] for _ in range(b)] for b in batches}
        plain = LLM(folder, **common)
        for b in batches:
            results["plain_async_ms_per_step"][b] = round(_step_ms(plain, prompts[b]), 3)
            print("plain async", b, results["plain_async_ms_per_step"][b], file=sys.stderr, flush=True)
        del plain
        _release()
        spec = {"method": "random-drafts", "num_speculative_tokens": MAX_K, "disable_by_batch_size": 4096}
        llm = LLM(folder, speculative_config=spec, **common)
        for b in batches:
            row = {}
            for k in (0, 1, 2, 3, 4, 6, 8):
                RandomDrafts.k = k
                row[k] = round(_step_ms(llm, prompts[b]), 3)
                print("batch", b, "k", k, row[k], file=sys.stderr, flush=True)
            results["ms_per_step"][b] = row
            stats = llm.llm_engine.get_stats()
            results.setdefault("accepted_tokens", {})[b] = stats.spec_num_accepted_tokens
        del llm
        _release()
    manager.unregister(name="bench-random-drafts")
    registry.clear_caches()
    # the speedup each acceptance length would give: tokens per step over relative step cost
    results["speedup_if_accepted"] = {  # per batch and k: the speedup at acceptance lengths 1 .. k + 1
        b: {k: [round(length * row[0] / row[k], 2) for length in range(1, k + 2)] for k in row if k}
        for b, row in results["ms_per_step"].items()
    }
    return results


def loaded(args: argparse.Namespace) -> dict[str, Any]:
    """Throughput at batch 128 (128 requests of 256 in / 256 out) with n-gram speculation
    configured (its default disable_by_batch_size leaves such steps without drafts) and without."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, vocab = _llama(Path(tmp))
        common = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
                      gpu_memory_utilization=0.85, enable_prefix_caching=False, max_num_seqs=128)
        rng = random.Random(1)
        prompts = [[rng.randrange(vocab) for _ in range(256)] for _ in range(128)]
        for name, extra in (("none", {}), ("ngram", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})):
            llm = LLM(folder, **common, **extra)
            _timed(llm, prompts[:16], 16)  # warm-up
            seconds = min(_timed(llm, prompts, 256) for _ in range(2))
            results[name] = round(128 * 256 / seconds, 1)
            print(name, results[name], "tok/s", file=sys.stderr, flush=True)
            del llm
            _release()
    results["ratio"] = round(results["ngram"] / results["none"], 3)
    return results


def _read_prompts(path: str, count: int, skip: int = 0) -> list[list[str]]:
    lines = [json.loads(line)["turns"] for line in Path(path).read_text().splitlines() if line.strip()]
    return lines[skip : skip + count]


def _chat_run(llm: LLM, conversations: list[list[dict[str, str]]], max_tokens: int) -> tuple[float, int, list[str]]:
    """Each conversation alone (batch 1), greedy; seconds, tokens, texts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    total, tokens, texts = 0.0, 0, []
    for messages in conversations:
        _sync()
        started = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        _sync()
        total += time.perf_counter() - started
        tokens += len(out.token_ids)
        texts.append(out.text)
    return total, tokens, texts


def _acceptance(llm: LLM) -> dict[str, float]:
    stats = llm.llm_engine.get_stats()
    drafts = max(stats.spec_num_drafts, 1)
    return {"mean_acceptance_length": round(1 + stats.spec_num_accepted_tokens / drafts, 3),
            "drafts": stats.spec_num_drafts, "draft_tokens": stats.spec_num_draft_tokens, "accepted": stats.spec_num_accepted_tokens}


def _drafter_specs(drafters: str, k: int, unchained: bool = False, verify_passes: int = 1) -> list[dict[str, Any]]:
    """``method=folder,...`` as speculative configs at ``k`` drafts, each with fixed-length
    verification (so that mean acceptance lengths compare: every step verifies all ``k``), and
    DSpark also with its default confidence-scheduled verification. ``unchained``: DFlash and
    DSpark also without their drafts chained behind verification (``UNCHAINED`` in the spec:
    the drafter runs once the step's tokens are read back). ``verify_passes`` above 1: DFlash
    and DSpark also with that many verify passes a step (both verifications for DSpark)."""
    specs = []
    for item in drafters.split(","):
        method, _, folder = item.partition("=")
        if method not in ("eagle3", "dflash", "dspark") or not folder:
            raise SystemExit(f"--drafters: {item!r} is not method=folder (eagle3, dflash or dspark)")
        specs.append({"method": method, "model": folder, "num_speculative_tokens": k, "verification": "fixed"})
        if unchained and method != "eagle3":
            specs.append({**specs[-1], UNCHAINED: True})
        fixed = specs[-1] if not unchained or method == "eagle3" else specs[-2]
        if method == "dspark":
            specs.append({"method": method, "model": folder, "num_speculative_tokens": k, "verification": "confidence"})
        if verify_passes > 1 and method != "eagle3":
            specs.append({**fixed, "verify_passes": verify_passes})
            if method == "dspark":
                specs.append({**fixed, "verification": "confidence", "verify_passes": verify_passes})
    return specs


#: a benchmark's mark on a speculative config: run it without chaining drafts behind verification
UNCHAINED = "unchained"
#: another: the work between verify passes queued on the device as separate operations (not one launch)
OPS_CHAIN = "ops_chain"


def _spec_engine(target: str, spec: dict[str, Any], **common: Any) -> LLM:
    """An engine with ``spec`` (``UNCHAINED`` read off it: the runner then drafts once each
    step's tokens are back, as before chaining)."""
    config = {key: value for key, value in spec.items() if key not in (UNCHAINED, OPS_CHAIN)}
    llm = LLM(target, speculative_config=config, **common)
    runner = llm.llm_engine.core.executor.worker.model_runner
    if spec.get(UNCHAINED):
        runner.spec.chain_drafts = False
    if spec.get(OPS_CHAIN):
        from sonar.spec_decode.device_passes import PassChain

        runner.pass_chain_cls = PassChain
    return llm


def real_target(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """Batch-1 greedy decode of a real target with and without ``method``: code edits
    (turn 1 the model's own solution, turn 2 asks for the same code with a docstring) for
    n-gram, the prompt set's first turns for a drafter (``drafters``: several beside one plain
    engine).

    The engines live side by side (each with the same KV-cache memory) and take turns
    conversation by conversation, the order rotated each time, for ``--rounds`` rounds: the
    host's speed drifts over a process's life, and a small target's step is mostly host work.
    Each engine's figure is its median round; each speedup the median of its rounds' ratios to
    the plain engine's same round."""
    common = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), quantization="unquantized")
    plain = LLM(args.target, **common)
    turns = _read_prompts(args.prompts, args.num_prompts, args.skip_prompts)
    if method == "ngram":
        firsts = [[{"role": "user", "content": t[0]}] for t in turns]
        _, _, answers = _chat_run(plain, firsts, 192)
        conversations = [m + [{"role": "assistant", "content": a},
                              {"role": "user", "content": "Write the same code again with a docstring added to the function; keep every other line exactly as it is."}]
                         for m, a in zip(firsts, answers)]
        specs = []
        for item in args.ngram_configs.split(","):  # k:prompt_lookup_min:prompt_lookup_max[:verify_passes[:ops]]
            fields = item.split(":")
            if len(fields) < 3 or fields[4:] not in ([], ["ops"]):
                raise SystemExit(f"--ngram-configs: {item!r} is not k:prompt_lookup_min:prompt_lookup_max[:verify_passes[:ops]]")
            k, min_n, max_n, *passes = (int(v) for v in fields[:4])
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": max_n}
            spec = {**spec, "verify_passes": passes[0]} if passes else spec
            specs.append({**spec, OPS_CHAIN: True} if fields[4:] == ["ops"] else spec)
    elif method == "drafters":
        conversations = [[{"role": "user", "content": t[0]}] for t in turns]
        specs = _drafter_specs(args.drafters, args.k, args.unchained, args.verify_passes)
    else:
        conversations = [[{"role": "user", "content": t[0]}] for t in turns]
        specs = [{"method": method, "model": args.drafter, "num_speculative_tokens": args.k}]
    engines = [plain] + [_spec_engine(args.target, spec, **common) for spec in specs]
    for llm in engines:
        _chat_run(llm, conversations[:2], 32)  # warm-up
    before = [_acceptance(llm) if i else None for i, llm in enumerate(engines)]
    seconds = [[0.0] * args.rounds for _ in engines]
    tokens = [[0] * args.rounds for _ in engines]
    texts: list[list[str]] = [[] for _ in engines]
    with contextlib.ExitStack() as stack:
        counters = [stack.enter_context(run_counters(llm.llm_engine)) for llm in engines]
        for round_index in range(args.rounds):
            for c, messages in enumerate(conversations):
                shift = (round_index + c) % len(engines)
                for i in [*range(shift, len(engines)), *range(shift)]:
                    s, n, text = _chat_run(engines[i], [messages], args.max_tokens)
                    seconds[i][round_index] += s
                    tokens[i][round_index] += n
                    if round_index == 0:
                        texts[i] += text
            print(f"round {round_index}:", [round(tokens[i][round_index] / seconds[i][round_index], 1) for i in range(len(engines))],
                  file=sys.stderr, flush=True)  # fmt: skip
    rates = [[n / s for n, s in zip(tokens[i], seconds[i])] for i in range(len(engines))]
    runs = []
    for i, spec in enumerate(specs, start=1):
        after = _acceptance(engines[i])
        drafts = after["drafts"] - before[i]["drafts"]
        accepted = after["accepted"] - before[i]["accepted"]
        spec_tokens = sum(tokens[i])
        ratios = [round(a / b, 3) for a, b in zip(rates[i], rates[0])]
        runs.append({
            "speculative_config": spec, "spec_tok_s": round(statistics.median(rates[i]), 1),
            "speedup": round(statistics.median(ratios), 3), "speedup_by_round": ratios,
            "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 3),
            "tokens_per_step": round(spec_tokens / max(spec_tokens - accepted, 1), 3),  # each step emits 1 + its accepted drafts
            "same_text": sum(a == b for a, b in zip(texts[0], texts[i])),
            "counters": per_step(counters[i]),
        })  # fmt: skip
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    del engines, plain
    _release()
    return {"method": method, "prompts": len(conversations), "rounds": args.rounds, "plain_tok_s": round(statistics.median(rates[0]), 1),
            "plain_tok_s_by_round": [round(r, 1) for r in rates[0]], "plain_counters": per_step(counters[0]), "runs": runs}  # fmt: skip


def batched(args: argparse.Namespace) -> dict[str, Any]:
    """A real target and a trained drafter at several batch sizes: output tok/s of the batch
    answering ``--batches`` held-out prompts at once (cycled where fewer), greedy, without
    speculation, with fixed-length verification (every draft, at every batch size) and with
    confidence-scheduled verification; the mean acceptance length of each.

    The three engines live side by side (each with the same KV-cache memory) and take turns:
    ``--rounds`` rounds at each batch size, each round running every engine once, the order
    rotated from round to round. A tiny target's step is mostly host work, and the host's speed
    drifts over a process's life; turns within a round see the same host, so the figures are
    the median per engine and each round's ratio to the plain engine of the same round."""
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), quantization="unquantized",
                  max_num_seqs=max(batches), enable_prefix_caching=False)  # fmt: skip
    turns = _read_prompts(args.prompts, args.num_prompts, args.skip_prompts)
    conversations = [[{"role": "user", "content": t[0]}] for t in turns]
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    for name in args.verifications.split(","):  # fixed, confidence; -unchained: without drafts chained behind verification
        verification, _, unchained = name.partition("-")
        configs[name] = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.k,
                         "verification": verification, "disable_by_batch_size": NO_BATCH_LIMIT, UNCHAINED: unchained == "unchained"}
    engines = {name: _spec_engine(args.target, spec, **common) if spec else LLM(args.target, **common) for name, spec in configs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm_up = SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS)
    results: dict[str, Any] = {"method": args.method, "k": args.k, "prompts": len(conversations), "rounds": args.rounds,
                               "tok_s": {}, "tok_s_by_round": {}, "speedup_by_round": {}, "acceptance": {}, "steps": {}}  # fmt: skip
    names = list(engines)
    for batch in batches:
        batch_conversations = [conversations[i % len(conversations)] for i in range(batch)]
        for llm in engines.values():
            # warm-up at this batch size: the shapes it brings compile outside the timed runs
            llm.chat(batch_conversations[::-1], warm_up, use_tqdm=False)
        before = {name: _acceptance(llm) for name, llm in engines.items() if configs[name]}
        by_round: dict[str, list[float]] = {name: [] for name in names}
        steps: dict[str, int] = dict.fromkeys(names, 0)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                llm = engines[name]
                with run_counters(llm.llm_engine, phase_timing=False) as counters:
                    _sync()
                    started = time.perf_counter()
                    outputs = llm.chat(batch_conversations, params, use_tqdm=False)
                    _sync()
                    seconds = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                by_round[name].append(round(tokens / seconds, 1))
                steps[name] += int(counters["steps"])
            print(batch, {name: values[-1] for name, values in by_round.items()}, file=sys.stderr, flush=True)
        for name in names:
            results["tok_s"].setdefault(name, {})[batch] = statistics.median(by_round[name])
            results["tok_s_by_round"].setdefault(name, {})[batch] = by_round[name]
            results["steps"].setdefault(name, {})[batch] = steps[name]
            if name != "none":
                ratios = [round(a / b, 3) for a, b in zip(by_round[name], by_round["none"])]
                results["speedup_by_round"].setdefault(name, {})[batch] = ratios
            if configs[name]:
                after = _acceptance(engines[name])
                drafts = after["drafts"] - before[name]["drafts"]
                accepted = after["accepted"] - before[name]["accepted"]
                results["acceptance"].setdefault(name, {})[batch] = {
                    "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 3), "drafts": drafts,
                    "draft_tokens": after["draft_tokens"] - before[name]["draft_tokens"], "accepted": accepted}
    del engines
    _release()
    results["speedup"] = {name: {b: round(statistics.median(r), 3) for b, r in row.items()} for name, row in results["speedup_by_round"].items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=["verify-cost", "loaded", "ngram", "eagle3", "dflash", "dspark", "drafters", "confidence", "batched"])
    parser.add_argument("--method", default="dspark", choices=["dspark", "dflash", "eagle3"], help="batched part: the drafter's method")
    parser.add_argument("--batches", default=None, help="default: 1,8,32,128 (confidence: 1,64,256)")
    parser.add_argument("--target", help="a real target model (a GGUF file or folder)")
    parser.add_argument("--drafter", help="the drafter's folder (eagle3, dflash, dspark parts)")
    parser.add_argument("--drafters", default="", help="drafters part: method=folder,... (eagle3, dflash, dspark), each beside one plain run")
    parser.add_argument("--prompts", help="a prompt file, one {\"turns\": [...]} a line")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--skip-prompts", type=int, default=0, help="leave out the first N (the drafter's training prompts)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--ngram-configs", default="5:2:4",
                        help="ngram part: comma-separated k:prompt_lookup_min:prompt_lookup_max[:verify_passes[:ops]], each measured beside the one plain run")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="batched, drafters, ngram, eagle3, dflash, dspark parts: the KV cache of each of the engines living side by side")
    parser.add_argument("--unchained", action="store_true", help="drafters part: DFlash and DSpark also without drafts chained behind verification")
    parser.add_argument("--verify-passes", type=int, default=1, help="drafters part: DFlash and DSpark also with this many verify passes a step")
    parser.add_argument("--verifications", default="fixed,confidence",
                        help="batched part: the speculative engines beside the plain one (fixed, confidence, and either with -unchained)")
    parser.add_argument("--rounds", type=int, default=3, help="batched and batch-1 parts: rounds of turns (the median is reported)")
    parser.add_argument("--output-json")
    spec_confidence.add_arguments(parser)
    args = parser.parse_args()
    if args.batches is None:
        args.batches = "1,64,256" if args.part in ("confidence", "batched") else "1,8,32,128"
    if args.part == "confidence":
        result = spec_confidence.confidence_part(args)
    elif args.part == "verify-cost":
        result = verify_cost(args)
    elif args.part == "loaded":
        result = loaded(args)
    elif args.part == "batched":
        result = batched(args)
    else:
        result = real_target(args, args.part)
    print(json.dumps(result, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
