"""``sonar bench throughput|latency``: measure the engine, with transformers as the peer.
``sonar bench serve`` (measuring a server over HTTP) is sonar-server's, registered as
``"bench serve"`` through ``sonar_register_cli_commands``."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from sonar.cli.bench_datasets import DATASETS
from sonar.cli.engine_args import add_engine_arguments, engine_args_from


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # stay clear of the ids where tokenizers keep special tokens
    low, high = min(100, vocab // 2), vocab - 1
    prompts = [[rng.randint(low, high) for _ in range(rng.randint(*input_range))] for _ in range(num_prompts)]
    output_lens = [rng.randint(*output_range) for _ in range(num_prompts)]
    return Workload(prompts, output_lens)


def dataset_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """``--num-prompts`` prompts of the ``--dataset-name`` file, tokenized by the engine's
    tokenizer (shuffled with ``--workload-seed``; cycled where the file has fewer)."""
    from sonar.cli.bench_datasets import read_custom, read_sharegpt, usable_pair

    if tokenizer is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs the model's tokenizer (it is text)")
    rng = random.Random(args.workload_seed)
    rows: list[tuple[list[int], int]] = []
    if args.dataset_name == "custom":
        prompts = read_custom(args.dataset_path)
        rng.shuffle(prompts)
        rows = [(tokenizer.encode(prompt), args.custom_output_len) for prompt in prompts[: args.num_prompts]]
    else:
        pairs = read_sharegpt(args.dataset_path)
        rng.shuffle(pairs)
        for prompt, reply in pairs:
            ids = tokenizer.encode(prompt)
            output_len = args.sharegpt_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
            if usable_pair(len(ids), output_len):
                rows.append((ids, output_len))
            if len(rows) == args.num_prompts:
                break
        if not rows:
            raise ValueError(f"--dataset-path {args.dataset_path!r}: no conversation passes the length filter")
    chosen = [rows[i % len(rows)] for i in range(args.num_prompts)]
    return Workload([ids for ids, _ in chosen], [n for _, n in chosen])


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_value = int(low)
    high_value = int(high) if high else low_value
    if low_value < 1 or high_value < low_value:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low_value, high_value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmark the engine")
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)

    throughput = kinds.add_parser("throughput", help="offline throughput on a random workload")
    add_engine_arguments(throughput)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--input-len", type=_range, default=(32, 512), help="N or MIN:MAX, uniform")
    throughput.add_argument("--output-len", type=_range, default=(32, 256), help="N or MIN:MAX, uniform")
    throughput.add_argument("--workload-seed", type=int, default=0)
    throughput.add_argument("--dataset-name", default="random", choices=DATASETS, help="random (--input-len, --output-len), or files of real text: sharegpt, custom (--dataset-path)")
    throughput.add_argument("--dataset-path", default=None, help="the sharegpt JSON file, or the custom JSON-lines file ({\"prompt\": ...} a line)")
    throughput.add_argument("--sharegpt-output-len", type=int, default=None, help="output tokens of every sharegpt prompt (default: its reply's length)")
    throughput.add_argument("--custom-output-len", type=int, default=256, help="output tokens of every custom prompt")
    throughput.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    throughput.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="run a few of the prompts briefly first, untimed (kernel compiles, allocator)")
    throughput.add_argument("--compare-hf", action="store_true", help="also run transformers' batched generate() on the same prompts")
    throughput.add_argument("--output-json", default=None)
    throughput.set_defaults(func=run_throughput, _command_parser=throughput)

    latency = kinds.add_parser("latency", help="time per output token of one batch")
    add_engine_arguments(latency)
    latency.add_argument("--batch-size", type=int, default=1)
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters", type=int, default=3)
    latency.add_argument("--output-json", default=None)
    latency.set_defaults(func=run_latency, _command_parser=latency)

    from sonar.cli.bench_suite import add_suite_parser  # here: it imports this module

    add_suite_parser(kinds)
    return parser


def _vocab_size(llm) -> int:
    return llm.llm_engine.model_config.vocab_size


def run_engine(llm, workload: Workload, ignore_eos: bool) -> tuple[float, int]:
    from sonar.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos, detokenize=False) for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_hf(model_path: str, dtype, workload: Workload) -> float:
    """transformers' generate() as a user would call it: one left-padded batch, greedy,
    until the longest requested output (min_new_tokens keeps eos from ending it early)."""
    import torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    longest = max(len(p) for p in workload.prompts)
    pad_id = 0
    input_ids = torch.full((len(workload.prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt):] = 1
    max_new = max(workload.output_lens)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, pad_token_id=pad_id,
        )
    return time.perf_counter() - started


def run_throughput(args: argparse.Namespace) -> int:
    from sonar.engine.process_util import freeze_startup_heap
    from sonar.entrypoints.llm import LLM

    if args.dataset_name != "random" and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    print("loading model...", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args_from(args))
    if args.dataset_name == "random":
        workload = random_workload(args.num_prompts, args.input_len, args.output_len, _vocab_size(llm), args.workload_seed)
    else:
        workload = dataset_workload(args, llm.get_tokenizer())
    if args.warmup:
        few = min(16, args.num_prompts)
        run_engine(llm, Workload(workload.prompts[:few], [min(8, n) for n in workload.output_lens[:few]]), True)
        if llm.llm_engine.core is not None:
            llm.llm_engine.core.kv_cache.reset_prefix_cache()  # the timed run computes every prompt
    freeze_startup_heap()  # the collector policy of the serving processes, so both sides compare alike
    stats_before = llm.llm_engine.get_stats()
    elapsed, num_output = run_engine(llm, workload, args.ignore_eos)
    stats_after = llm.llm_engine.get_stats()
    total = workload.num_prompt_tokens + num_output
    result = {
        "engine": "sonar",
        "num_prompts": args.num_prompts,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round(total / elapsed, 2),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": num_output,
    }
    print(f"sonar:        {result['requests_per_s']:.2f} requests/s, {result['output_tokens_per_s']:.1f} output tok/s, "
          f"{result['total_tokens_per_s']:.1f} total tok/s ({elapsed:.1f} s)")
    if stats_before is not None and stats_after is not None and stats_after.spec_num_drafts > stats_before.spec_num_drafts:
        drafts = stats_after.spec_num_drafts - stats_before.spec_num_drafts
        draft_tokens = stats_after.spec_num_draft_tokens - stats_before.spec_num_draft_tokens
        accepted = stats_after.spec_num_accepted_tokens - stats_before.spec_num_accepted_tokens
        proposed = stats_after.spec_num_proposed_tokens - stats_before.spec_num_proposed_tokens
        result["mean_acceptance_length"] = round(1 + accepted / drafts, 3)
        result["draft_tokens"] = {"proposed": proposed, "verified": draft_tokens, "accepted": accepted}
        print(f"speculative decoding: mean acceptance length {result['mean_acceptance_length']:.2f} "
              f"({accepted} of {draft_tokens} draft tokens accepted over {drafts} verify steps; {proposed} proposed)")
    if args.compare_hf:
        dtype = llm.llm_engine.model_config.dtype
        model_path = llm.llm_engine.model_config.model
        del llm
        hf_elapsed = run_hf(model_path, dtype, workload)
        hf = {
            "elapsed_s": round(hf_elapsed, 3),
            "requests_per_s": round(args.num_prompts / hf_elapsed, 3),
            "output_tokens_per_s": round(workload.num_output_tokens / hf_elapsed, 2),
            "total_tokens_per_s": round((workload.num_prompt_tokens + workload.num_output_tokens) / hf_elapsed, 2),
        }
        result["transformers"] = hf
        result["speedup"] = round(hf_elapsed / elapsed, 2)
        print(f"transformers: {hf['requests_per_s']:.2f} requests/s, {hf['output_tokens_per_s']:.1f} output tok/s, "
              f"{hf['total_tokens_per_s']:.1f} total tok/s ({hf_elapsed:.1f} s)")
        print(f"sonar / transformers throughput: {result['speedup']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """End-to-end time of one batch, and its decode time per step with the prefill taken out:
    (time for output_len tokens - time for 1 token) / (output_len - 1), best of num_iters."""
    from sonar.engine.process_util import freeze_startup_heap
    from sonar.entrypoints.llm import LLM

    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2 to separate decode from prefill")
    print("loading model...", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args_from(args))
    workload = random_workload(args.batch_size, (args.input_len, args.input_len), (args.output_len, args.output_len), _vocab_size(llm), 0)
    prefill_only = Workload(workload.prompts, [1] * args.batch_size)
    kv_cache = llm.llm_engine.core.kv_cache

    def best_of(w: Workload) -> float:
        times = []
        for _ in range(args.num_iters):
            kv_cache.reset_prefix_cache()  # every run computes its prompt
            times.append(run_engine(llm, w, True)[0])
        return min(times)

    run_engine(llm, Workload(workload.prompts, [4] * args.batch_size), True)  # warm-up
    freeze_startup_heap()  # the collector policy of the serving processes
    total = best_of(workload)
    prefill = best_of(prefill_only)
    decode_ms = 1000 * (total - prefill) / (args.output_len - 1)
    print(
        f"batch {args.batch_size}, {args.input_len} in / {args.output_len} out: {total:.3f} s end to end, "
        f"prefill {1000 * prefill:.1f} ms, decode {decode_ms:.2f} ms per step"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"batch_size": args.batch_size, "total_s": total, "prefill_s": prefill, "decode_ms_per_step": decode_ms}, f, indent=2)
    return 0
