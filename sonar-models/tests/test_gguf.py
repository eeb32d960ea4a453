"""The real SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0), natively quantized and dequantized, against
transformers' own GGUF loader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from sonar_models.formats import GGUFFormat
from sonar_models.formats.gguf_file import hf_name, unpermute_rotary_rows
from sonar_models.testing import PagedCacheDriver, load_sonar_model, smollm2_gguf_path


NATIVE_LOGIT_ATOL = 0.5  # logits span about 30


@pytest.fixture(scope="module")
def gguf_model() -> tuple[Any, Any, torch.nn.Module]:
    fmt, path = GGUFFormat(), smollm2_gguf_path()
    return fmt.load_hf_config(path), fmt.load_tokenizer(path), load_sonar_model(path)


def test_config_from_metadata(gguf_model) -> None:
    config, _, model = gguf_model
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, model.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings  # the file has no output.weight
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_tokenizer_has_chat_template_and_eos(gguf_model) -> None:
    _, tokenizer, _ = gguf_model
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_transformers_gguf_loader(gguf_model) -> None:
    config, tokenizer, ours = gguf_model
    prompt = tokenizer("The capital of France is")["input_ids"]
    # oracle: transformers dequantizes and un-permutes the same file its own way
    reference = HFLlama(config).eval()
    parsed = load_gguf_checkpoint(str(smollm2_gguf_path()), return_tensors=True, model_to_load=reference)
    for key, value in parsed["config"].items():
        if key not in ("model_type", "_model_name_or_path", "unk_token_id", "rope_theta"):
            assert getattr(config, key) == value, key
    reference.load_state_dict(parsed["tensors"], strict=False)
    reference.tie_weights()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    # dequantized at load (quantization="unquantized"): the same float32 numbers
    dequantized = load_sonar_model(smollm2_gguf_path(), quantization="unquantized")
    logits = dequantized.compute_logits(PagedCacheDriver(dequantized).step(dequantized, [(0, prompt)]))
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    # natively quantized (the default): bfloat16 inside the int4 kernels
    native = ours.compute_logits(PagedCacheDriver(ours).step(ours, [(0, prompt)]))
    assert (native - expected).abs().max() < NATIVE_LOGIT_ATOL
    assert tokenizer.decode(native[-1].argmax()) == " Paris"


def test_tensor_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_name("blk.0.ssm_a.weight")


def test_unpermute_inverts_the_interleaving_of_rotary_pairs() -> None:
    heads, head_dim, cols = 3, 8, 5
    weight = torch.randn(heads * head_dim, cols)
    # llama.cpp's layout: per head, row 2i is the first half's row i, row 2i + 1 the second half's
    halves = weight.view(heads, 2, head_dim // 2, cols)
    interleaved = halves.transpose(1, 2).reshape(heads * head_dim, cols)
    assert torch.equal(unpermute_rotary_rows(interleaved, heads), weight)


def test_llama3_rope_factors_become_rope_parameters() -> None:
    import math
    from types import SimpleNamespace

    import numpy as np

    from sonar_models.formats.gguf_metadata import _llama3_scaling_from_factors

    # the per-frequency divisors llama.cpp's converter stores for Llama 3.1 (factor 8)
    head_dim, theta, factor, old_context = 128, 500000.0, 8.0, 8192
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_context / 4.0:
            factors.append(1.0)
        elif wavelen > old_context / 1.0:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    tensor = SimpleNamespace(name="rope_freqs.weight", data=np.array(factors, dtype=np.float32))
    scaling = _llama3_scaling_from_factors(SimpleNamespace(tensors=[tensor]), head_dim, theta)
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
