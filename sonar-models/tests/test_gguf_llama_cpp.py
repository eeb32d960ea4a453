"""llama.cpp reads the files ``write_gguf`` writes as transformers reads the weights in them:
an independent check that the test writer (and so the reader it exercises) follows llama.cpp's
conventions for every mapped architecture, not only Sonar's own. Runs where llama-cpp-python
is installed (it compiles llama.cpp for minutes, so CI does not install it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sonar_models.formats.gguf_blocks import IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from sonar_models.formats.gguf_quantize import write_gguf
from sonar_models.testing import build_tiny_model, smollm2_gguf_path
from test_gguf_architectures import ARCHS

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT = [1, 504, 3458, 282, 4649, 314, 21, 1040, 2188, 11099, 28, 17, 420, 9125, 2055, 30, 415, 750, 260, 1789, 19]  # past the window of 8
F32 = 0
GGML_TYPE_F32 = 0  # llama.cpp's KV cache type, so that its cache rounds nothing
#: logits apart (span about 6, Gemma 3's 13): llama.cpp's GELU reads a float16 table, so the
#: Gemma models differ by a few thousandths a layer; the others by nothing measurable
F32_ATOL = {"gemma2": 0.02, "gemma3": 0.05}


def _both(arch: str, kind: int | str, tmp_path: Path, **shape) -> tuple[np.ndarray, np.ndarray]:
    """``(transformers' logits on the weights in the file, llama.cpp's)`` for the prompt."""
    folder = build_tiny_model(arch, tmp_path / "hf", **{**ARCHS.get(arch, {}), **shape})
    path = tmp_path / "model.gguf"
    stored = write_gguf(folder, path, kind, tokenizer_from=smollm2_gguf_path())
    dequantized = tmp_path / "dequantized"
    shutil.copytree(folder, dequantized)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(dequantized / "model.safetensors"))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()(torch.tensor([PROMPT])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, n_threads=2, verbose=False,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False)
    llm.eval(PROMPT)
    return expected, np.array(llm.scores[: len(PROMPT)])


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_llama_cpp_computes_what_transformers_does_from_a_float_file(arch: str, tmp_path: Path) -> None:
    expected, got = _both(arch, F32, tmp_path)
    assert np.abs(expected - got).max() < F32_ATOL.get(arch, 0.005)
    assert (expected.argmax(-1) == got.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_llama_cpp_reads_a_q8_0_file_alike(arch: str, tmp_path: Path) -> None:
    """Q8_0: llama.cpp also rounds its activations to 8 bits, so close, not equal."""
    expected, got = _both(arch, Q8_0, tmp_path)
    assert np.corrcoef(expected.ravel(), got.ravel())[0, 1] > 0.995
    assert (expected.argmax(-1) == got.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("recipe", [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "Q4_K_M", Q5_0, Q5_1, IQ4_NL, IQ4_XS])
def test_llama_cpp_reads_k_quant_and_5_bit_files_alike(recipe: int | str, tmp_path: Path) -> None:
    """Super-blocks of 256 (Sonar's K-quant encoder, and llama.cpp's mixed Q4_K_M recipe over
    eight layers) and the 5-bit blocks of 32: llama.cpp decodes them as transformers reads the
    decoded weights. llama.cpp rounds the activations of the K-quant products to 8 bits in
    blocks of 256, so on this model the logits correlate 0.995-0.996 (Q8_0, blocks of 32: 0.998)
    and the top token agrees on 62-81% of the positions (Q8_0: 81%); a misread field would not
    correlate."""
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8)
    expected, got = _both("llama", recipe, tmp_path, **shape)
    assert np.corrcoef(expected.ravel(), got.ravel())[0, 1] > 0.99
    assert (expected.argmax(-1) == got.argmax(-1)).mean() >= 0.5
