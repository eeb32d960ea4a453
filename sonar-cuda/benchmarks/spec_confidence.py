"""Confidence-scheduled verification on one device: where the scheduler cuts, and what it gives.

    # Llama-3.1-8B dummy bf16 on a GPU (batches 1, 64, 256; 7 drafts a request)
    python sonar-cuda/benchmarks/spec_decode.py --part confidence --output-json confidence.json
    # the same code on the CPU with a tiny model (to know it runs)
    python sonar-cuda/benchmarks/spec_decode.py --part confidence --tiny

What it prints and returns:

1. ``cost_curve``: the target's step time by tokens per step, as the engine profiled it at
   start-up (``StepCostModel``).
2. ``verified_lengths``: per batch size, the drafts the policy verifies per request for the
   survival profile given (``--survival``, the chance that drafts 1..j all survive), with a
   third of the requests easier (the profile's square root) and a third harder (its square):
   for each class, how many requests verify 0, 1, ..., k drafts, on the step of a batch of
   decodes.
3. ``throughput``: output tokens per second of the batch decoding ``--output-len`` tokens,
   with no speculation, fixed verification (every draft, no batch-size limit) and
   confidence-scheduled verification. The drafts come from an oracle proposer (below) that
   costs nothing to run, so the three differ by verification alone; ``drafts`` gives the
   draft tokens proposed, verified and accepted, ``schedule_ms_per_step`` the scheduler's
   host time per step (the policy included).
4. ``drafter_ms_per_step``: what a DSpark drafter shaped for the target (random weights, 5
   layers, Markov head, confidence head) spends per step drafting for the whole batch, to
   add to the verification's cost when reading (3).
5. ``policy_ms_per_choice``: the policy's own time for one step at batch 256 with 7 drafts.

The oracle proposer drafts the target's own greedy continuation (recorded by the plain run),
keeping draft ``j`` right with the chance ``survival[j] / survival[j - 1]`` (a wrong token
otherwise), and reports the request's survival profile as its confidence: acceptance then
follows the profile (a random-weight target has no drafts of its own worth accepting). In
bfloat16 a random-weight target's logits are so close that a verify step's rounding changes
its greedy tokens and nearly nothing is accepted; ``--dtype float32`` keeps them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sonar import LLM, SamplingParams, registry
from sonar.hookspecs import hookimpl
from sonar.plugins import get_plugin_manager
from sonar.spec_decode import DraftTokens, Proposer, ProposerInputs
from sonar.spec_decode.verification import ConfidenceVerification
from sonar.worker.phase_timer import PhaseTimer

DSPARK_SURVIVAL = "0.88,0.76,0.65,0.55,0.46,0.38,0.31"  # about DSpark's acceptance length 4 on chat
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def request_survival(profile: list[float], index: int) -> list[float]:
    """Request ``index``'s survival: the profile, its square root (easy) or its square (hard)."""
    power = (1.0, 0.5, 2.0)[index % 3]
    return [p**power for p in profile]


class OracleDrafts(Proposer):
    """The target's recorded greedy continuation as drafts, right with the profile's chances
    (set between runs: ``continuations`` by prompt, ``profile``, ``prompt_len``, ``vocab``)."""

    continuations: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # prompt -> (its index, continuation)
    profile: list[float] = []
    prompt_len = 0
    vocab = 2

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.rng = random.Random(0)

    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        k = self.config.num_speculative_tokens
        drafts: list[list[int]] = []
        confidence: list[list[float] | None] = []
        for tokens in inputs.token_ids:
            entry = self.continuations.get(tuple(tokens[: self.prompt_len]))
            position = len(tokens) - self.prompt_len
            if entry is None or position >= len(entry[1]):
                drafts.append([])
                confidence.append(None)
                continue
            index, continuation = entry
            survival = request_survival(self.profile, index)[:k]
            truth = continuation[position : position + len(survival)]
            row, alive, previous = [], True, 1.0
            for token, chance in zip(truth, survival):
                alive = alive and self.rng.random() < chance / previous
                previous = chance
                row.append(token if alive else (token + 1) % self.vocab)
            drafts.append(row)
            confidence.append(survival[: len(row)])
        return DraftTokens(list(inputs.req_ids), drafts, confidence=confidence)


class _Plugin:
    @hookimpl
    def sonar_register_speculative_proposers(self, register) -> None:
        register("oracle-drafts", OracleDrafts)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    gc.collect()
    _sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    _sync()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def _counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.spec_num_proposed_tokens, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def _target(root: Path, tiny: bool) -> tuple[Path, dict[str, Any]]:
    from sonar.cli.bench_suite import MODELS

    config = TINY_LLAMA if tiny else MODELS["Llama-3.1-8B"]
    folder = root / ("tiny-llama" if tiny else "Llama-3.1-8B")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder, config


def _throughput_runs(args, folder: Path, common: dict[str, Any], prompts: list[list[int]], batches: list[int], k: int) -> dict[str, Any]:
    results: dict[str, Any] = {"throughput": {}, "drafts": {}, "schedule_ms_per_step": {}}
    runs: list[tuple[str, dict[str, Any] | None]] = [("none", None)]
    for verification in ("fixed", "confidence"):
        spec = {"method": "oracle-drafts", "num_speculative_tokens": k, "verification": verification}
        if verification == "fixed":
            spec["disable_by_batch_size"] = 1 << 20  # every draft at every batch size
        runs.append((verification, spec))
    for name, spec in runs:
        llm = LLM(str(folder), speculative_config=spec, **common)
        _generate(llm, prompts[:2], 4)  # warm-up
        if spec is None:  # the target's own continuations, for the oracle's drafts
            _, continuations = _generate(llm, prompts, args.output_len + k + 1)
            OracleDrafts.continuations = {tuple(p): (i, c) for i, (p, c) in enumerate(zip(prompts, continuations))}
        if name == "confidence":
            results["cost_model"] = llm.llm_engine.core.step_costs
            results["max_num_batched_tokens"] = llm.llm_engine.config.max_num_batched_tokens
        timer = PhaseTimer()  # the scheduler's host time (the policy's included)
        for b in batches:
            before = _counters(llm)
            steps_before = llm.llm_engine.get_stats().num_steps
            timer.enable([(llm.llm_engine.core.scheduler, "schedule", "schedule")])
            seconds = float("inf")
            for _ in range(args.repeats):
                elapsed, outputs = _generate(llm, prompts[:b], args.output_len)
                if any(len(tokens) != args.output_len for tokens in outputs):
                    raise RuntimeError(f"{name} at batch {b}: a request ended early (an aborted step?)")
                seconds = min(seconds, elapsed)
            schedule_s = timer.take().get("schedule", 0.0)
            timer.disable()
            steps = (llm.llm_engine.get_stats().num_steps - steps_before) or 1
            results["throughput"].setdefault(str(b), {})[name] = round(b * args.output_len / seconds, 1)
            results["schedule_ms_per_step"].setdefault(str(b), {})[name] = round(1000 * schedule_s / steps, 4)
            if name != "none":
                proposed, verified, accepted = (a - c for a, c in zip(_counters(llm), before))
                results["drafts"].setdefault(str(b), {})[name] = {"proposed": proposed, "verified": verified, "accepted": accepted}
            print(name, "batch", b, results["throughput"][str(b)][name], "tok/s", file=sys.stderr, flush=True)
        del llm
        _release()
    for b, row in results["throughput"].items():
        row["fixed_vs_none"] = round(row["fixed"] / row["none"], 3)
        row["confidence_vs_none"] = round(row["confidence"] / row["none"], 3)
    return results


def _verified_lengths(costs, profile: list[float], batches: list[int], budget: int) -> dict[str, Any]:
    """For each batch of decodes, how many requests of each class verify 0..k drafts."""
    from sonar.spec_decode.stats import SpecDecodeStats

    k = len(profile)
    lengths: dict[str, Any] = {}
    for b in batches:
        policy = ConfidenceVerification(costs, k, budget, SpecDecodeStats())
        rows = [request_survival(profile, i) for i in range(b)]
        chosen = policy.choose(rows, [k] * b, b, b, budget - b)
        by_class: dict[str, list[int]] = {}
        for name, offset in (("profile", 0), ("easy", 1), ("hard", 2)):
            counts = collections.Counter(chosen[i] for i in range(offset, b, 3))
            by_class[name] = [counts.get(n, 0) for n in range(k + 1)]
        lengths[str(b)] = {"requests_verifying_0_to_k": by_class, "step_tokens": b + sum(chosen),
                           "expected_tokens_per_s": round((b + sum(sum(r[:n]) for r, n in zip(rows, chosen))) / costs.cost(b + sum(chosen)), 1)}  # fmt: skip
    return lengths


def _policy_ms(costs, profile: list[float], budget: int) -> float:
    from sonar.spec_decode.stats import SpecDecodeStats

    k = len(profile)
    rng = random.Random(0)
    policy = ConfidenceVerification(costs, k, budget, SpecDecodeStats())
    rows = [[p ** rng.uniform(0.5, 2.0) for p in profile] for _ in range(256)]
    policy.choose(rows, [k] * 256, 256, 256, budget - 256)
    started = time.perf_counter()
    for _ in range(100):
        policy.choose(rows, [k] * 256, 256, 256, budget - 256)
    return round(10 * (time.perf_counter() - started), 4)  # ms per choice


def _drafter_ms(args, folder: Path, config: dict[str, Any], common: dict[str, Any], prompts: list[list[int]], batches: list[int], k: int) -> dict[str, float]:
    """A random DSpark drafter for the target: host milliseconds per ``propose`` call (it
    reads its drafts back, so the device's work is in it) at each batch size."""
    from transformers import LlamaConfig

    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter

    hf = LlamaConfig(**{key: value for key, value in config.items() if key not in ("architectures", "model_type")})
    layers = hf.num_hidden_layers
    ids = sorted({1, *(round(i * (layers - 3) / 4) + 1 for i in range(1, 5))})  # five layers across the target, as DeepSpec's
    drafter_config = drafter_config_for(hf, "deepspec", k + 1, args.drafter_layers, ids, hf.vocab_size - 1, markov_rank=min(256, hf.hidden_size),
                                        markov_head_type="vanilla", confidence_head=True)  # fmt: skip
    dtype = torch.bfloat16 if not args.tiny else torch.float32
    with torch.device("cpu"):
        drafter = init_drafter(DFlashDrafter(drafter_config).to(dtype), std=0.02)
    shared = torch.zeros(1, hf.hidden_size, dtype=dtype).expand(hf.vocab_size, hf.hidden_size)
    with tempfile.TemporaryDirectory() as tmp:
        save_dflash(drafter, Path(tmp) / "dspark", embedding=shared, lm_head=shared)
        del drafter
        spec = {"method": "dspark", "model": str(Path(tmp) / "dspark"), "num_speculative_tokens": k,
                "verification": "fixed", "disable_by_batch_size": 1 << 20}  # fmt: skip
        llm = LLM(str(folder), speculative_config=spec, **common)
    proposer = llm.llm_engine.core.executor.worker.model_runner.spec.proposer
    timer = PhaseTimer()
    results = {}
    _generate(llm, prompts[:2], 4)
    for b in batches:
        calls = collections.Counter()
        original = proposer.propose

        def counted(inputs, _original=original, _calls=calls):
            _calls["n"] += 1
            return _original(inputs)

        proposer.propose = counted
        timer.enable([(proposer, "propose", "drafter")])
        _generate(llm, prompts[:b], min(args.output_len, 32))
        seconds = timer.take().get("drafter", 0.0)
        timer.disable()
        del proposer.propose
        results[str(b)] = round(1000 * seconds / max(calls["n"], 1), 3)
        print("drafter batch", b, results[str(b)], "ms per step", file=sys.stderr, flush=True)
    del llm
    _release()
    return results


def confidence_part(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the module docstring lists."""
    tiny = args.tiny or not torch.cuda.is_available()
    args.tiny = tiny
    profile = [float(p) for p in args.survival.split(",")]
    k = len(profile)
    batches = [int(b) for b in args.batches.split(",")]
    manager = get_plugin_manager()
    manager.register(_Plugin(), name="bench-oracle-drafts")
    registry.clear_caches()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder, config = _target(Path(tmp), tiny)
            OracleDrafts.profile, OracleDrafts.prompt_len, OracleDrafts.vocab = profile, args.input_len, config["vocab_size"]
            rng = random.Random(0)
            prompts = [[rng.randrange(3, config["vocab_size"]) for _ in range(args.input_len)] for _ in range(max(batches))]
            max_model_len = args.input_len + args.output_len + 2 * k + 16
            common = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=max_model_len, enable_prefix_caching=False,
                          max_num_seqs=max(batches), dtype=args.dtype or ("float32" if tiny else "bfloat16"))  # fmt: skip
            if tiny:
                common["kv_cache_memory_bytes"] = 2**26
            else:
                common["gpu_memory_utilization"] = 0.85
            results = _throughput_runs(args, folder, common, prompts, batches, k)
            costs = results.pop("cost_model")
            budget = results.pop("max_num_batched_tokens")
            results = {
                "target": "tiny Llama (CPU)" if tiny else "Llama-3.1-8B dummy bf16", "survival": profile, "batches": batches,
                "cost_curve_tokens_ms": costs.as_rows(), "cost_context_len": costs.context_len,
                "verified_lengths": _verified_lengths(costs, profile, batches, budget),
                "policy_ms_per_choice_batch256_k%d" % k: _policy_ms(costs, profile, budget), **results,
            }  # fmt: skip
            if not args.no_drafter:
                results["drafter_ms_per_step"] = _drafter_ms(args, folder, config, common, prompts, batches, k)
    finally:
        manager.unregister(name="bench-oracle-drafts")
        registry.clear_caches()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (the default without CUDA)")
    parser.add_argument("--survival", default=DSPARK_SURVIVAL, help="the confidence profile: survival of drafts 1..k")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per batch (the fastest counts)")
    parser.add_argument("--drafter-layers", type=int, default=5, help="layers of the DSpark drafter timed")
    parser.add_argument("--no-drafter", action="store_true", help="skip timing a DSpark drafter")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default bfloat16 on a GPU; float32 keeps a random-weight "
                        "target's greedy tokens the same in verify and decode steps, which the oracle's acceptance needs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--output-json")
    add_arguments(parser)
    args = parser.parse_args()
    result = confidence_part(args)
    print(json.dumps(result, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
