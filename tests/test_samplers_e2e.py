"""The creative samplers end to end through ``LLM.generate`` on a tiny random model: DRY breaks
a greedy repetition loop, 64 seeded requests with mixed samplers match their runs alone, and a
logits-processor plugin installed as a package applies to the requests naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import site_has_entry_point, with_site
from sonar import LLM, SamplingParams

LOOP_PROMPT = [100, 200, 300, 400] * 6  # a repeated pattern: greedy decoding loops after it


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models with one or a few requests per step are overhead-bound: one thread is
    faster, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)


def longest_repeated_ngram(tokens: list[int]) -> int:
    """The largest n such that some n-gram occurs twice in ``tokens``."""
    longest = 0
    for n in range(1, len(tokens)):
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        if len(set(grams)) == len(grams):
            break
        longest = n
    return longest


@pytest.mark.parametrize("allowed_length", [2, 3])
def test_dry_stops_a_repetition_loop(llm: LLM, allowed_length: int) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    looping = llm.generate({"prompt_token_ids": LOOP_PROMPT}, greedy)[0].outputs[0].token_ids
    assert longest_repeated_ngram(looping) >= 8, f"the prompt should make greedy loop: {looping}"

    dry = greedy.clone(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=allowed_length)
    tokens = llm.generate({"prompt_token_ids": LOOP_PROMPT}, dry)[0].outputs[0].token_ids
    assert len(tokens) == 48
    assert longest_repeated_ngram(tokens) <= allowed_length + 1, tokens


MIXED = [
    dict(temperature=0.0, dry_multiplier=0.8),
    dict(temperature=0.9, top_k=40, top_p=0.9),
    dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05),
    dict(temperature=1.0, mirostat_mode=2, mirostat_tau=4.0),
    dict(temperature=1.0, mirostat_mode=1, mirostat_tau=5.0),
    dict(temperature=0.8, typical_p=0.8, tfs=0.9),
    dict(temperature=1.2, top_a=0.1, min_p=0.02),
    dict(temperature=1.0, eta_cutoff=5.0, epsilon_cutoff=3.0),
    dict(temperature=1.0, smoothing_factor=0.3, smoothing_curve=1.5),
    dict(dynatemp_min=0.5, dynatemp_max=1.5, dynatemp_exponent=1.5),
    dict(temperature=0.7, nsigma=1.0, skew=0.3),
    dict(temperature=1.0, no_repeat_ngram_size=2, repetition_penalty=1.2, repetition_penalty_range=20),
    dict(temperature=0.6, temperature_last=True, min_p=0.1),
    dict(temperature=1.0, sampler_priority=["xtc", "temperature", "min_p"], xtc_probability=0.3, min_p=0.05),
    dict(temperature=1.0, dry_multiplier=1.0, dry_allowed_length=1, presence_penalty=0.5),
    dict(temperature=1.0, bad_words_token_ids=[[300, 400]], allowed_token_ids=list(range(100, 2000))),
]


def test_64_mixed_sampler_requests_match_each_alone(llm: LLM) -> None:
    from conftest import random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts(64, seed=21, min_len=4, max_len=40)]
    params = [
        SamplingParams(seed=500 + i, max_tokens=8, ignore_eos=True, **MIXED[i % len(MIXED)]) for i in range(64)
    ]
    batched = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate(prompt, p)[0].outputs[0].token_ids for prompt, p in zip(prompts, params)]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == 64


@pytest.fixture(scope="module")
def example_plugin(plugin_site) -> Path:
    """The example plugin package, installed where this module's fresh process sees it."""
    site = plugin_site("sonar_example_processor")
    assert site_has_entry_point(site, "example_processor"), "the installed sonar-example-processor lacks its entry point"
    return site


# a fresh process discovers the installed entry point, as a user's would
PLUGIN_PROBE = """
import json, sys
from sonar import LLM, SamplingParams
from sonar.plugins import plugin_report
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
prompt = {"prompt_token_ids": json.loads(sys.argv[2])}
outs = llm.generate([prompt, prompt], [greedy, greedy.clone(logits_processors=["no_immediate_repeat"])])
print(json.dumps({"loaded": plugin_report().loaded, "plain": outs[0].outputs[0].token_ids, "processed": outs[1].outputs[0].token_ids}))
"""


def test_installed_logits_processor_plugin_applies_to_its_requests(example_plugin: Path, tiny_model_dir) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE, str(tiny_model_dir("llama")), json.dumps(LOOP_PROMPT)],
        capture_output=True, text=True, timeout=300, env=with_site({**os.environ, "OMP_NUM_THREADS": "1"}, example_plugin),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["loaded"]["example_processor"] == "sonar_example_processor.plugin"
    plain, ids = seen["plain"], seen["processed"]
    assert any(a == b for a, b in zip(plain, plain[1:])), "greedy alone repeats a token right away"
    assert all(a != b for a, b in zip([LOOP_PROMPT[-1]] + ids, ids))
