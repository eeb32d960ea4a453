"""LoRA shrink + expand on Llama-3.1-8B's projections against the base product, per layer kind.

    python sonar-cuda/benchmarks/lora_kernels.py [--out lora.json] [--sweep] [--rank 16] [--adapters 8]
        [--layers qkv,o,gate_up,down] [--batches batch-1,decode-64,prefill-2048,prefill-4x512]

For each projection (qkv 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate_up 4096 -> 2 x 14336,
down 14336 -> 4096) and batch (batch 1; 64 decode tokens, the 8 adapters mixed and shuffled;
a 2048-token prefill of one adapter; four 512-token prompts of three adapters and the base),
microseconds, each timed as a CUDA graph replayed over copies of the layer's weights that
together exceed L2 (each decode layer finds its LoRA weights in memory, not in cache):

- ``base``: ``torch.nn.functional.linear`` alone;
- ``base_lora``: the same product followed by the engine's two launches into its output
  (``lora_shrink_expand`` past ``FUSED_TOKENS``: the shrink, the sum of its split partials
  where it splits, then the expand);
- ``lora``: ``base_lora - base``, what the adapters add to the layer; ``ratio``: ``base_lora / base``;
- ``overlap``: ``base_overlap - base``, where ``base_overlap`` is the engine's path up to
  ``OVERLAP_TOKENS`` tokens: the shrink started on the side stream (``lora_shrink_begin``)
  before the product, joined before the expand;
- ``fused``: ``base`` + the single-launch ``lora_shrink_expand`` minus ``base`` (batches of up to
  64 tokens: past ``FUSED_TOKENS`` the engine does not use it, the figure says whether it should);
- ``shrink``, ``expand``: each alone (copies of its weights only: an L2-warm lower bound).

Each case is first checked against float32 torch versions of ``sonar.lora.ops`` from the same
weights (the intermediate not rounded; largest error over the largest value of the reference;
``ok``: below 1e-3 for the shrink, 2e-2 for the layer's output, fused and not, and rows
without an adapter unchanged). ``per_layer`` sums the four kinds: one decoder layer's
projections without the adapters, with the two launches, and fused. ``--sweep`` also times alternative
launches (``LoRALaunch``) per case, each as ``base`` + the kernel minus ``base``. Prints a
table and writes one JSON document to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

import sonar_cuda.graph_timing
from sonar.lora.ops import torch_lora_expand, torch_lora_shrink
from sonar_cuda.kernels.lora import (
    DECODE_TOKENS,
    FUSED_TOKENS,
    LoRALaunch,
    expand_launch,
    fused_launch,
    lora_expand,
    lora_shrink,
    lora_shrink_begin,
    lora_shrink_expand,
    shrink_launch,
)

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
LAYERS = {  # in, part sizes
    "qkv": (HIDDEN, (HIDDEN, KV, KV)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    "down": (INTERMEDIATE, (HIDDEN,)),
}
BYTES_PER_CASE = 400e6  # the copies of one layer's base weight, together: beyond the 50 MB L2
DTYPE = torch.bfloat16
DEVICE = "cuda"


def timed(calls: list) -> float:
    """Microseconds per call, replayed from one CUDA graph (``sonar_cuda.graph_timing``)."""
    return sonar_cuda.graph_timing.graph_us(calls)


def batches(num_adapters: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    decode = torch.arange(64) % num_adapters
    decode = decode[torch.randperm(64, generator=gen)]
    return {
        "batch-1": [min(3, num_adapters - 1)],
        "decode-64": decode.tolist(),
        "prefill-2048": [0] * 2048,
        "prefill-4x512": [1 % num_adapters] * 512 + [5 % num_adapters] * 512 + [-1] * 512 + [2 % num_adapters] * 512,
    }


class Case:
    """One layer kind at one batch: copies of its base weight and adapters, inputs, slots."""

    def __init__(self, layer: str, slots: list[int], rank: int, num_adapters: int) -> None:
        k, sizes = LAYERS[layer]
        num_out = sum(sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.parts = tuple((s, s + n) for s, n in zip(starts, sizes))
        copies = max(2, int(BYTES_PER_CASE // (num_out * k * 2)))
        self.weights = [torch.randn(num_out, k, device=DEVICE, dtype=DTYPE) * 0.02 for _ in range(copies)]
        n = len(sizes) * rank
        self.a = [torch.randn(num_adapters, n, k, device=DEVICE, dtype=DTYPE) / k**0.5 for _ in range(copies)]
        self.b = [torch.randn(num_adapters, num_out, rank, device=DEVICE, dtype=DTYPE) / rank**0.5 for _ in range(copies)]
        self.slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        self.x = torch.randn(len(slots), k, device=DEVICE, dtype=DTYPE)
        self.y = lora_shrink(self.x, self.a[0], self.slots)

    @property
    def fusable(self) -> bool:
        return self.x.shape[0] <= DECODE_TOKENS

    def fused_default(self) -> LoRALaunch:
        return fused_launch(
            self.weights[0].shape[0], self.x.shape[1], self.b[0].shape[-1], self.x.shape[0], self.b[0].shape[0], DTYPE, self.x.device
        )

    def check(self) -> dict:
        """Largest error over the largest reference value, shrink and expand (of base + delta),
        against float32 products of the same weights."""
        base = torch.nn.functional.linear(self.x, self.weights[0])
        y = lora_shrink(self.x, self.a[0], self.slots)
        out = lora_expand(y, self.b[0], self.slots, base.clone(), self.parts)
        y_ref = torch_lora_shrink(self.x.float(), self.a[0].float(), self.slots)
        out_ref = torch_lora_expand(y_ref, self.b[0].float(), self.slots, base.float().clone(), self.parts)
        delta_ref = (out_ref - base.float()).abs().max().item()
        scale = max(out_ref.abs().max().item(), 1e-30)
        shrink_err = (y - y_ref).abs().max().item() / max(y_ref.abs().max().item(), 1e-30)
        out_err = (out.float() - out_ref).abs().max().item() / scale
        untouched = bool(torch.equal(out[self.slots < 0], base[self.slots < 0]))
        result = {"shrink_err": round(shrink_err, 6), "out_err": round(out_err, 6), "delta_max": round(delta_ref, 4)}
        ok = shrink_err < 1e-3 and out_err < 2e-2 and untouched
        if self.fusable:
            fused = lora_shrink_expand(self.x, self.a[0], self.b[0], self.slots, base.clone(), self.parts, self.fused_default())
            result["fused_err"] = round((fused.float() - out_ref).abs().max().item() / scale, 6)
            ok = ok and result["fused_err"] < 2e-2 and bool(torch.equal(fused[self.slots < 0], base[self.slots < 0]))
        result["ok"] = ok
        return result

    def base_calls(self) -> list:
        return [lambda w=w: torch.nn.functional.linear(self.x, w) for w in self.weights]

    def lora_calls(self, overlapped: bool = False) -> list:
        def call(w, a, b):
            join = lora_shrink_begin(self.x, a, self.slots) if overlapped else None
            out = torch.nn.functional.linear(self.x, w)
            if join is not None:  # the engine's path at decode sizes: the shrink ran beside the product
                return lora_expand(join(), b, self.slots, out, self.parts)
            if self.fusable and self.x.shape[0] <= FUSED_TOKENS:  # the engine's choice: time the two launches
                return lora_expand(lora_shrink(self.x, a, self.slots), b, self.slots, out, self.parts)
            return lora_shrink_expand(self.x, a, b, self.slots, out, self.parts)

        return [lambda w=w, a=a, b=b: call(w, a, b) for w, a, b in zip(self.weights, self.a, self.b)]

    def fused_calls(self, launch: LoRALaunch | None = None) -> list:
        launch = launch or self.fused_default()

        def call(w, a, b):
            out = torch.nn.functional.linear(self.x, w)
            return lora_shrink_expand(self.x, a, b, self.slots, out, self.parts, launch)

        return [lambda w=w, a=a, b=b: call(w, a, b) for w, a, b in zip(self.weights, self.a, self.b)]

    def shrink_calls(self, launch: LoRALaunch | None = None, with_base: bool = False) -> list:
        def call(w, a):
            if with_base:
                torch.nn.functional.linear(self.x, w)
            return lora_shrink(self.x, a, self.slots, launch)

        return [lambda w=w, a=a: call(w, a) for w, a in zip(self.weights, self.a)]

    def expand_calls(self, launch: LoRALaunch | None = None, with_base: bool = False) -> list:
        out = torch.zeros(self.x.shape[0], self.weights[0].shape[0], device=DEVICE, dtype=DTYPE)

        def call(w, b):
            if with_base:
                torch.nn.functional.linear(self.x, w)
            return lora_expand(self.y, b, self.slots, out, self.parts, launch)

        return [lambda w=w, b=b: call(w, b) for w, b in zip(self.weights, self.b)]


def time_case(case: Case) -> dict:
    base = timed(case.base_calls())
    base_lora = timed(case.lora_calls())
    result = {
        "base": base,
        "base_lora": base_lora,
        "lora": round(base_lora - base, 2),
        "ratio": round(base_lora / base, 3),
        "base_overlap": (overlap := timed(case.lora_calls(overlapped=True))),
        "overlap": round(overlap - base, 2),
        "shrink": timed(case.shrink_calls()),
        "expand": timed(case.expand_calls()),
    }
    if case.fusable:
        result["base_fused"] = timed(case.fused_calls())
        result["fused"] = round(result["base_fused"] - base, 2)
    return result


def shrink_alternatives(num_tokens: int, n: int) -> list[LoRALaunch]:
    chosen = shrink_launch(num_tokens, n, DTYPE)
    launches = [chosen]
    for block_k in (128, 256):
        for split in (0, 1, 2, 4, 8, 16, 32):
            launches.append(LoRALaunch(chosen.block_m, chosen.block_n, block_k, split_k=split))
    for block_n in (16, 32, 64):
        launches.append(LoRALaunch(chosen.block_m, block_n, chosen.block_k))
    launches.append(LoRALaunch(chosen.block_m, chosen.block_n, 512, num_stages=2))
    if num_tokens > 1:
        launches += [LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, slot_programs=1), LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, slot_programs=8)]
    launches += [LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, num_stages=s) for s in (2, 4)]
    return list(dict.fromkeys(launches))


def expand_alternatives(num_tokens: int, rank: int) -> list[LoRALaunch]:
    chosen = expand_launch(num_tokens, rank)
    launches = [chosen]
    for block_n in (32, 64, 128, 256):
        for warps in (4, 8):
            launches.append(LoRALaunch(chosen.block_m, block_n, chosen.block_k, num_warps=warps))
    if num_tokens > 1:
        launches += [LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, slot_programs=p) for p in (1, 2, 8)]
    if num_tokens > 64:
        launches += [LoRALaunch(m, n, chosen.block_k, num_warps=w) for m in (32, 64, 128) for n in (64, 128, 256) for w in (4, 8)]
    launches += [LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, num_stages=s) for s in (1, 2)]
    return list(dict.fromkeys(launches))


def fused_alternatives(chosen: LoRALaunch, num_tokens: int) -> list[LoRALaunch]:
    launches = [chosen]
    for block_n in (32, 64, 128, 256, 512):
        for block_k in (128, 256, 512):
            launches.append(LoRALaunch(chosen.block_m, block_n, block_k, num_warps=8 if block_n >= 256 else 4, block_r=chosen.block_r))
    for warps, stages in ((4, 3), (8, 3), (4, 2), (4, 4), (8, 4)):
        launches.append(LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, num_warps=warps, num_stages=stages, block_r=chosen.block_r))
    if num_tokens > 1:
        launches += [LoRALaunch(chosen.block_m, chosen.block_n, chosen.block_k, slot_programs=p, block_r=chosen.block_r) for p in (1, 2)]
    return list(dict.fromkeys(launches))


def label(launch: LoRALaunch) -> str:
    return f"m{launch.block_m}n{launch.block_n}k{launch.block_k}s{launch.split_k}p{launch.slot_programs}w{launch.num_warps}st{launch.num_stages}"


def sweep_case(case: Case, rank: int, kinds_swept: tuple[str, ...] = ("shrink", "expand", "fused")) -> dict:
    base = timed(case.base_calls())
    num_tokens, n = case.x.shape[0], case.a[0].shape[1]
    result: dict = {"shrink": {}, "expand": {}}
    for launch in shrink_alternatives(num_tokens, n) if "shrink" in kinds_swept else ():
        try:
            result["shrink"][label(launch)] = round(timed(case.shrink_calls(launch, with_base=True)) - base, 2)
        except (OutOfResources, CompilationError) as error:  # a launch the GPU cannot take: noted, not fatal
            result["shrink"][label(launch)] = f"{type(error).__name__}: {str(error)[:120]}"
    for launch in expand_alternatives(num_tokens, rank) if "expand" in kinds_swept else ():
        try:
            result["expand"][label(launch)] = round(timed(case.expand_calls(launch, with_base=True)) - base, 2)
        except (OutOfResources, CompilationError) as error:
            result["expand"][label(launch)] = f"{type(error).__name__}: {str(error)[:120]}"
    kinds = ["shrink", "expand"]
    if case.fusable and "fused" in kinds_swept:
        kinds.append("fused")
        result["fused"] = {}
        for launch in fused_alternatives(case.fused_default(), num_tokens):
            try:
                result["fused"][label(launch)] = round(timed(case.fused_calls(launch)) - base, 2)
            except (OutOfResources, CompilationError) as error:
                result["fused"][label(launch)] = f"{type(error).__name__}: {str(error)[:120]}"
    for kind in kinds:
        measured = {key: us for key, us in result[kind].items() if isinstance(us, float)}
        result[f"best_{kind}"] = min(measured, key=measured.get) if measured else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON results")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--sweep", action="store_true", help="also time alternative launches per case")
    parser.add_argument("--sweep-kinds", default="shrink,expand,fused", help="the launches --sweep times: comma-separated shrink, expand, fused")
    parser.add_argument("--layers", default=",".join(LAYERS), help="comma-separated layer kinds")
    parser.add_argument("--batches", default=None, help="comma-separated batches (default: all)")
    args = parser.parse_args()
    all_batches = batches(args.adapters)
    chosen_batches = args.batches.split(",") if args.batches else list(all_batches)
    summary: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "rank": args.rank,
        "adapters": args.adapters,
        "cases": {},
        "per_layer": {},
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1))

    started = time.perf_counter()
    print(f"{'case':<24}{'base':>10}{'base+lora':>11}{'lora':>9}{'overlap':>9}{'fused':>9}{'ratio':>8}{'shrink':>9}{'expand':>9}{'out_err':>10}{'ok':>4}", flush=True)
    for batch in chosen_batches:
        for layer in args.layers.split(","):
            case = Case(layer, all_batches[batch], args.rank, args.adapters)
            result = {**case.check(), **time_case(case)}
            if args.sweep:
                result["sweep"] = sweep_case(case, args.rank, tuple(args.sweep_kinds.split(",")))
            summary["cases"][f"{layer} {batch}"] = result
            print(
                f"{layer + ' ' + batch:<24}{result['base']:>10.2f}{result['base_lora']:>11.2f}{result['lora']:>9.2f}{result['overlap']:>9.2f}"
                f"{result['fused'] if 'fused' in result else '-':>9}{result['ratio']:>8.3f}{result['shrink']:>9.2f}{result['expand']:>9.2f}{result['out_err']:>10.2e}{'yes' if result['ok'] else 'NO':>4}",
                flush=True,
            )
            if args.sweep:
                best_fused = result["sweep"].get("best_fused")
                best = {kind: result["sweep"].get(f"best_{kind}") for kind in ("shrink", "expand", "fused")}
                print(f"    best shrink {best['shrink']}, best expand {best['expand']}, best fused {best_fused}", flush=True)
                if best_fused:
                    print(f"    fastest fused: {result['sweep']['fused'][best_fused]} us", flush=True)
            del case
            torch.cuda.empty_cache()
            save()
        kinds = [summary["cases"].get(f"{layer} {batch}") for layer in args.layers.split(",")]
        base = sum(k["base"] for k in kinds)
        base_lora = sum(k["base_lora"] for k in kinds)
        base_overlap = sum(k["base_overlap"] for k in kinds)
        per_layer = {"base": round(base, 2), "base_lora": round(base_lora, 2), "ratio": round(base_lora / base, 3),
                     "base_overlap": round(base_overlap, 2), "overlap_ratio": round(base_overlap / base, 3)}
        fused = "-"
        if all("base_fused" in k for k in kinds):
            base_fused = sum(k["base_fused"] for k in kinds)
            per_layer |= {"base_fused": round(base_fused, 2), "fused_ratio": round(base_fused / base, 3)}
            fused = f"{base_fused - base:.2f}"
        summary["per_layer"][batch] = per_layer
        print(f"{'  one decoder layer':<24}{base:>10.2f}{base_lora:>11.2f}{base_lora - base:>9.2f}{base_overlap - base:>9.2f}{fused:>9}{base_lora / base:>8.3f}", flush=True)
        save()
    summary["seconds"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps(summary["per_layer"]))


if __name__ == "__main__":
    main()
