"""Our decoders against Hugging Face transformers on the same tiny checkpoints (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sonar_models.testing import TINY_CONFIGS, PagedCacheDriver, load_sonar_model

ATOL = 1e-4
PROMPT_A = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 1345, 314, 3119, 28, 5123, 17, 30, 2]
PROMPT_B = [7, 9981, 301, 12, 44, 10, 49151, 12000, 77, 3, 5, 5, 5, 31000, 142, 8, 1200, 91, 17, 17, 4000, 6, 2048]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def pair(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    path = tiny_model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_sonar_model(path), hf


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()  # [T, vocab]


def test_one_sequence_matches_hf(pair) -> None:
    ours, hf = pair
    driver = PagedCacheDriver(ours, block_size=4)
    logits = ours.compute_logits(driver.step(ours, [(0, PROMPT_A)]))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT_A), atol=ATOL, rtol=0)


def test_two_sequences_in_one_flat_batch_match_hf(pair) -> None:
    ours, hf = pair
    driver = PagedCacheDriver(ours, block_size=4)
    logits = ours.compute_logits(driver.step(ours, [(0, PROMPT_A), (1, PROMPT_B)]))
    torch.testing.assert_close(logits[: len(PROMPT_A)], hf_logits(hf, PROMPT_A), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(PROMPT_A) :], hf_logits(hf, PROMPT_B), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_hf(pair) -> None:
    ours, hf = pair
    full = PROMPT_B + [321, 654]
    expected = hf_logits(hf, full)
    driver = PagedCacheDriver(ours, block_size=4)
    first = ours.compute_logits(driver.step(ours, [(0, PROMPT_B[:9])]))
    # second chunk attends over the first chunk's cached keys/values
    second = ours.compute_logits(driver.step(ours, [(0, PROMPT_B[9:])]))
    decode = ours.compute_logits(driver.step(ours, [(0, [321])]))
    torch.testing.assert_close(torch.cat([first, second, decode]), expected[:-1], atol=ATOL, rtol=0)
    # a decode laid out first, next to another sequence's prefill, as the engine batches them
    mixed = ours.compute_logits(driver.step(ours, [(0, [654]), (1, PROMPT_A)]))
    torch.testing.assert_close(mixed[0], expected[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1:], hf_logits(hf, PROMPT_A), atol=ATOL, rtol=0)


def test_sizes_for_the_kv_cache(tiny_model_dirs: dict[str, Path]) -> None:
    qwen3 = load_sonar_model(tiny_model_dirs["qwen3"])
    assert (qwen3.num_layers, qwen3.num_kv_heads, qwen3.head_dim) == (2, 2, 32)  # explicit head_dim


def test_tied_and_untied_embeddings(tiny_model_dirs: dict[str, Path]) -> None:
    tied = load_sonar_model(tiny_model_dirs["qwen2"])
    untied = load_sonar_model(tiny_model_dirs["llama"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_bfloat16_model_keeps_rotary_in_float32(tiny_model_dirs: dict[str, Path]) -> None:
    ours = load_sonar_model(tiny_model_dirs["llama3"]).to(torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama3"], dtype=torch.bfloat16).eval()
    driver = PagedCacheDriver(ours, dtype=torch.bfloat16)
    logits = ours.compute_logits(driver.step(ours, [(0, PROMPT_A)]))
    assert logits.dtype == torch.float32
    assert ours.model.rotary_emb._inv_freq.dtype == torch.float32
    # bf16 rounding differs between fused and separate projections; argmax must still agree
    reference = hf_logits(hf, PROMPT_A)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    torch.testing.assert_close(logits, reference, atol=0.1, rtol=0)


def test_linear_rope_scaling_matches_hf(tmp_path: Path) -> None:
    from sonar_models.testing import build_tiny_model

    path = build_tiny_model("llama", tmp_path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    ours, hf = load_sonar_model(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logits = ours.compute_logits(PagedCacheDriver(ours).step(ours, [(0, PROMPT_B)]))
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT_B), atol=ATOL, rtol=0)


def test_gemma2_config_without_layer_types_alternates_its_windows() -> None:
    """A Gemma 2 config from before ``layer_types`` (transformers 4.x) slides in its even
    layers, as Gemma 2 does; with ``layer_types`` they decide."""
    from transformers import Gemma2Config

    from sonar_models.gemma import Gemma2ForCausalLM

    model = Gemma2ForCausalLM.__new__(Gemma2ForCausalLM)  # only its window rule is asked
    config = Gemma2Config(num_hidden_layers=5, sliding_window=16, layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"])
    assert model.layer_windows(config) == [None, 16, None, 16, None]
    config.layer_types = None
    assert model.layer_windows(config) == [16, None, 16, None, 16]
