"""``kv_cache_dtype="fp8"`` (E4M3) and ``"fp8_e5m2"`` end to end on the CPU: greedy tokens equal
to the float32 cache's wherever its top two logprobs are not near a tie, twice the KV blocks of
bf16 in the same memory, E4M3's per-layer scales read from a checkpoint (1.0 and one warning
without them), E5M2 unscaled whatever the checkpoint has, and clear refusals of unknown values
and of platforms without an FP8 cache."""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar import LLM, SamplingParams
from sonar.config import EngineArgs
from sonar.engine.resolve import resolve_kv_cache_dtype
from sonar.model_interface import PagedAttention
from sonar.platform import Platform

NUM_TOKENS = 16
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TIE = 0.2  # nats between the top two logprobs under which either token is a fair greedy pick (the FP8 cache moves logprobs by up to ~0.12)
LOGPROB_TOLERANCE = 0.15  # nats: how far the FP8 cache may move a token's logprob on the same context
# on the same contexts (teacher forced): (tie, logprob tolerance, the share of positions that
# must be clear of a tie). E5M2, with one mantissa bit less, moves logprobs 1.7 times as far as
# E4M3 on average (by up to 0.17 nats here, E4M3 0.14) and changed a top token at a margin of
# 0.285 nats (E4M3: 0.108), so it gets twice E4M3's logprob tolerance and a wider tie, which
# fewer positions of this tiny random model clear (31 of 151 at 0.3 nats, 56 at 0.2)
TEACHER_FORCED = {"fp8": (TIE, LOGPROB_TOLERANCE, 0.3), "fp8_e5m2": (0.3, 2 * LOGPROB_TOLERANCE, 0.2)}
MEMORY = 4 << 20


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sonar_models.testing import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("kv-fp8") / "llama")


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(rng.randint(5, 60))] for _ in range(count)]


def generate(path: Path, kv_cache_dtype: str, token_prompts: list[list[int]], **options) -> tuple[LLM, list]:
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=kv_cache_dtype, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    return llm, llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)


def top_two(logprobs: dict) -> list[tuple[float, int]]:
    return sorted(((lp.logprob, token) for token, lp in logprobs.items()), reverse=True)[:2]


def assert_diverges_only_at_ties(reference: list, candidate: list) -> None:
    """Free-running greedy: the candidate's tokens equal the reference's up to the first
    position where they differ, and there the reference's top two were within ``TIE``."""
    for ref, cand in zip(reference, candidate):
        ref_out, cand_out = ref.outputs[0], cand.outputs[0]
        for t, (expected, actual) in enumerate(zip(ref_out.token_ids, cand_out.token_ids)):
            if actual != expected:
                (first, _), (second, _) = top_two(ref_out.logprobs[t])
                assert first - second < TIE, f"token {t} differs where the reference's margin is {first - second:.3f} nats"
                break


def assert_teacher_forced_argmax_equal(path: Path, sequences: list[list[int]], fp8: str = "fp8", **options) -> None:
    """On the same contexts (``sequences`` as prompts, chunked prefills over the cache), the
    FP8 cache's top token equals the float32 cache's wherever its margin is ``TIE`` or more, on
    most positions, and the logprob of each position's token moves by under
    ``LOGPROB_TOLERANCE`` (E5M2: wider margins, see ``TEACHER_FORCED``)."""
    tie, tolerance, share = TEACHER_FORCED[fp8]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    runs = {}
    for kv_cache_dtype in ("auto", fp8):
        llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=kv_cache_dtype, **options)
        runs[kv_cache_dtype] = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    compared = total = 0
    for ref, cand, sequence in zip(runs["auto"], runs[fp8], sequences):
        for t in range(1, len(sequence)):
            ref_lp, cand_lp = ref.prompt_logprobs[t], cand.prompt_logprobs[t]
            drift = abs(cand_lp[sequence[t]].logprob - ref_lp[sequence[t]].logprob)
            assert drift < tolerance, f"position {t}: logprob moved by {drift:.3f} nats"
            (first, expected), (second, _) = top_two(ref_lp)
            total += 1
            if first - second >= tie:
                assert top_two(cand_lp)[0][1] == expected, f"position {t}: top token differs at a margin of {first - second:.3f}"
                compared += 1
    assert compared >= share * total, f"only {compared} of {total} positions were clear of a tie"


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
def test_fp8_cache_greedy_equals_the_float32_cache(tiny_llama: Path, fp8: str) -> None:
    token_prompts = prompts(4, seed=3)
    _, reference = generate(tiny_llama, "auto", token_prompts)
    _, quantized = generate(tiny_llama, fp8, token_prompts)
    assert_diverges_only_at_ties(reference, quantized)
    sequences = [p + r.outputs[0].token_ids for p, r in zip(token_prompts, reference)]
    assert_teacher_forced_argmax_equal(tiny_llama, sequences, fp8, max_num_batched_tokens=32)


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_with_prefix_caching_and_chunked_prefill(tiny_llama: Path, fp8: str) -> None:
    """Prompts sharing a 48-token prefix, prefilled in chunks of 32 tokens: the cached FP8
    blocks serve the later prompts as they served the first."""
    shared = prompts(1, seed=8)[0][:40] * 2
    token_prompts = [shared[:48] + tail for tail in prompts(3, seed=9)]
    _, reference = generate(tiny_llama, "auto", token_prompts, max_num_batched_tokens=32, enable_prefix_caching=False)
    llm, quantized = generate(tiny_llama, fp8, token_prompts, max_num_batched_tokens=32)
    assert_diverges_only_at_ties(reference, quantized)
    assert llm.llm_engine.get_stats().prefix_cache_hits >= 48, "later prompts found the shared prefix cached"


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
def test_fp8_doubles_the_blocks_of_bf16_in_the_same_memory(tiny_llama: Path, fp8: str) -> None:
    blocks = {}
    for kv_cache_dtype in ("auto", fp8):
        llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=kv_cache_dtype)
        runner = llm.llm_engine.core.executor.worker.model_runner
        blocks[kv_cache_dtype] = llm.llm_engine.core.cache_config.num_blocks
        assert runner.kv_caches[0].dtype == FP8_DTYPES.get(kv_cache_dtype, torch.bfloat16)
    assert blocks[fp8] == 2 * blocks["auto"]


def write_scaled_checkpoint(source: Path, folder: Path, layout: str) -> dict[int, tuple[float, float]]:
    """A copy of ``source`` whose attention layers carry KV-cache scales in ``layout``
    (``"k_v"``: ``k_scale`` and ``v_scale``; ``"kv"``: the older single ``kv_scale``)."""
    import shutil

    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    num_layers = 1 + max(int(name.split(".")[2]) for name in tensors if name.startswith("model.layers."))
    expected = {}
    for i in range(num_layers):
        k_scale, v_scale = 0.25 * (i + 1), 0.125 * (i + 1)
        prefix = f"model.layers.{i}.self_attn"
        if layout == "k_v":
            tensors[f"{prefix}.k_scale"], tensors[f"{prefix}.v_scale"] = torch.tensor(k_scale), torch.tensor(v_scale)
        else:
            tensors[f"{prefix}.kv_scale"] = torch.tensor(k_scale)
            v_scale = k_scale
        expected[i] = (k_scale, v_scale)
    save_file(tensors, str(folder / "model.safetensors"))
    return expected


def attention_scales(llm: LLM) -> dict[int, tuple[float, float]]:
    model = llm.llm_engine.core.executor.worker.model_runner.model
    return {m.layer_idx: (m.k_scale, m.v_scale) for m in model.modules() if isinstance(m, PagedAttention)}


@pytest.mark.parametrize("layout", ["k_v", "kv"])
def test_scales_come_from_the_checkpoint(tiny_llama: Path, tmp_path: Path, layout: str, caplog: pytest.LogCaptureFixture) -> None:
    expected = write_scaled_checkpoint(tiny_llama, tmp_path / "scaled", layout)
    with caplog.at_level(logging.WARNING):
        llm, outputs = generate(tmp_path / "scaled", "fp8", prompts(2, seed=4))
    assert attention_scales(llm) == expected
    assert not [r for r in caplog.records if "k_scale/v_scale" in r.getMessage()]
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)


def test_scales_default_to_one_with_one_warning(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory_bytes=MEMORY, kv_cache_dtype="fp8")
    assert set(attention_scales(llm).values()) == {(1.0, 1.0)}
    warnings = [r.getMessage() for r in caplog.records if "k_scale/v_scale" in r.getMessage()]
    assert len(warnings) == 1 and "use 1.0" in warnings[0]


def test_e5m2_is_unscaled_whatever_the_checkpoint_has(tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """E5M2 runs with scales of 1.0 (as in vLLM): a checkpoint's scales are not used (one note
    says so), and a checkpoint without them gets no warning."""
    write_scaled_checkpoint(tiny_llama, tmp_path / "scaled", "k_v")
    with caplog.at_level(logging.INFO, logger="sonar.model_interface"):
        llm, outputs = generate(tmp_path / "scaled", "fp8_e5m2", prompts(2, seed=4))
    assert set(attention_scales(llm).values()) == {(1.0, 1.0)}
    notes = [r.getMessage() for r in caplog.records if "k_scale/v_scale" in r.getMessage()]
    assert len(notes) == 1 and "not used" in notes[0] and caplog.records[0].levelno == logging.INFO
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sonar.model_interface"):
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory_bytes=MEMORY, kv_cache_dtype="fp8_e5m2")
    assert set(attention_scales(llm).values()) == {(1.0, 1.0)}
    assert not [r for r in caplog.records if "k_scale/v_scale" in r.getMessage()]


def test_an_unscaled_checkpoint_with_the_model_dtype_cache_warns_nothing(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory_bytes=MEMORY)
    assert not [r for r in caplog.records if "k_scale/v_scale" in r.getMessage()]


def test_unknown_values_and_platforms_without_fp8_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'int4'; choose one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineArgs(kv_cache_dtype="int4")

    class NoFp8Platform(Platform):
        name = "no-fp8"

    assert resolve_kv_cache_dtype("fp8", type("Cpu", (Platform,), {"kv_cache_dtypes": ("auto", "fp8_e4m3")})) == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported on the 'no-fp8' platform; it supports auto"):
        resolve_kv_cache_dtype("fp8", NoFp8Platform)
    e4m3_only = type("E4m3Only", (Platform,), {"name": "e4m3-only", "kv_cache_dtypes": ("auto", "fp8_e4m3")})
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' is not supported on the 'e4m3-only' platform; it supports auto, fp8_e4m3"):
        resolve_kv_cache_dtype("fp8_e5m2", e4m3_only)


def test_the_command_line_flag_reaches_the_engine_config(tiny_llama: Path) -> None:
    from sonar.cli.engine_args import add_engine_arguments, engine_args_from
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from(parser.parse_args([str(tiny_llama), "--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"
    config, _ = resolve_engine_config(args, current_platform())
    assert config.kv_cache_dtype == "fp8_e4m3" and config.kv_cache_torch_dtype == torch.float8_e4m3fn
    config, _ = resolve_engine_config(engine_args_from(parser.parse_args([str(tiny_llama), "--kv-cache-dtype", "fp8_e5m2"])), current_platform())
    assert config.kv_cache_dtype == "fp8_e5m2" and config.kv_cache_torch_dtype == torch.float8_e5m2
    with pytest.raises(SystemExit):
        parser.parse_args([str(tiny_llama), "--kv-cache-dtype", "fp4"])
