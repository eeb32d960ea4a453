"""Step-time cost of the sampler: one ``Sampler`` call on a batch of 64 × vocab 49152, with every
sampler on versus none (plain temperature + top-p), median over repeats.

    python sonar-core/benchmarks/sampler_cost.py [--device cpu|cuda] [--repeats 30] [--context 1024]

Each request has ``--context`` tokens of prompt and output (DRY, no-repeat-ngram and the
penalties scan them). The figure includes building ``SamplingMetadata`` (as the runner does each
step) and is printed in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from sonar.sampler import RequestSamplingState, Sampler, SamplingMetadata
from sonar.sampling_params import SamplingParams

BATCH, VOCAB = 64, 49152

NONE = dict(temperature=0.8, top_p=0.95)
ALL = dict(
    temperature=0.8, top_k=100, top_p=0.95, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.2,
    frequency_penalty=0.1, dry_multiplier=0.8, dry_allowed_length=2, dry_sequence_breaker_ids=[198, 28, 1],
    xtc_probability=0.5, xtc_threshold=0.1, typical_p=0.95, tfs=0.95, top_a=0.05, eta_cutoff=3.0,
    epsilon_cutoff=3.0, smoothing_factor=0.2, nsigma=2.0, no_repeat_ngram_size=6, skew=0.1,
    bad_words_token_ids=[[5, 6, 7], [8]],
)  # fmt: skip


def make_states(options: dict, context: int, seeded: bool, mirostat: bool) -> list[RequestSamplingState]:
    rng = random.Random(0)
    states = []
    for i in range(BATCH):
        extra = dict(mirostat_mode=1 + i % 2, mirostat_tau=5.0) if mirostat and i % 4 == 0 else {}
        if mirostat and i % 4 == 1:
            extra = dict(dynatemp_min=0.5, dynatemp_max=1.5)
        params = SamplingParams(seed=i if seeded else None, **options, **extra)
        tokens = [rng.randrange(100, VOCAB) for _ in range(context)]
        generator = torch.Generator().manual_seed(i) if seeded else None
        states.append(RequestSamplingState(params, tokens[: context // 2], tokens[context // 2 :], generator, [2]))
    return states


def time_step(states: list[RequestSamplingState], device: torch.device, repeats: int) -> float:
    sampler = Sampler()
    logits = torch.randn(BATCH, VOCAB, device=device) * 3
    times = []
    for _ in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        meta = SamplingMetadata.build(states, VOCAB, device)
        sampler(logits, meta).sampled_token_ids.tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [
        ("none (temperature + top-p)", make_states(NONE, args.context, False, False)),
        ("all samplers, unseeded", make_states(ALL, args.context, False, True)),
        ("all samplers, seeded", make_states(ALL, args.context, True, True)),
    ]
    print(f"batch {BATCH} x vocab {VOCAB}, context {args.context} tokens, {device}, {torch.get_num_threads()} threads")
    for name, states in rows:
        print(f"{name:32s} {time_step(states, device, args.repeats):8.2f} ms")


if __name__ == "__main__":
    main()
