"""GGUF files of a tiny random Llama in each natively run format (written by Sonar's own
quantizer) load quantized, multiply like their dequantized weights, and generate greedy tokens
and top-5 logprobs equal to transformers on the dequantized model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sonar import LLM, SamplingParams, ops
from sonar_cpu import gguf_kernel
from sonar_models.formats.gguf_blocks import IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPE_NAMES
from sonar_models.formats.gguf_quant import BLOCK_KERNEL_MAX_ROWS, DENSE_MIN_ROWS, _Blocks, _Packed
from sonar_models.formats.gguf_quantize import write_gguf
from sonar_models.testing import build_tiny_model, load_sonar_model

TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, "Q4_K_M"]  # the last: llama.cpp's mixed recipe (Q4_K, some Q6_K)


def type_name(ggml_type: int | str) -> str:
    return ggml_type if isinstance(ggml_type, str) else TYPE_NAMES[ggml_type]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
#: nats: decode steps round the activations (to int8 blocks of 32 in the C kernels, to bfloat16
#: in torch's int4 kernel); on this random model the largest gap measured was 0.22 (Q5_K),
#: 0.09-0.15 for the other formats
LOGPROB_ATOL = 0.3
NEAR_TIE = 0.2  # nats between the oracle's top two tokens: greedy may pick either
RELATIVE_ERROR = 0.02  # of a layer's output against the dequantized weights' product (float32)


def transformers_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-probabilities, recomputing the whole sequence."""
    tokens, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            rows.append(logprobs)
            tokens.append(int(logprobs.argmax()))
    return tokens[len(prompt) :], rows


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    from sonar_cpu import quant_ops

    ops.register_ops("cpu", quant_ops.OPS)
    yield
    ops.unregister_ops("cpu")


@pytest.fixture(scope="module", params=TYPES, ids=[type_name(t) for t in TYPES])
def gguf_checkpoint(request, tmp_path_factory) -> tuple[int, Path, Path, dict[str, torch.Tensor]]:
    """``(type, .gguf file, dequantized Hugging Face folder, dequantized tensors)``; Q8_0 ties
    its quantized embedding to the head."""
    ggml_type = request.param
    tied = ggml_type == Q8_0
    root = tmp_path_factory.mktemp(type_name(ggml_type))
    folder = build_tiny_model("llama", root / "hf", tie_word_embeddings=tied, **SHAPE)
    path = root / "model.gguf"
    stored = write_gguf(folder, path, ggml_type, quantize_embedding=tied)
    dequantized = root / "dequantized"
    shutil.copytree(folder, dequantized)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(dequantized / "model.safetensors"))
    return ggml_type, path, dequantized, stored


def test_layers_stay_quantized_and_multiply_like_the_dequantized_weights(gguf_checkpoint) -> None:
    ggml_type, path, _, stored = gguf_checkpoint
    model = load_sonar_model(path)
    layer = model.model.layers[0]
    cases = [
        (layer.mlp.gate_up_proj, torch.cat([stored["model.layers.0.mlp.gate_proj.weight"], stored["model.layers.0.mlp.up_proj.weight"]])),
        (layer.mlp.down_proj, stored["model.layers.0.mlp.down_proj.weight"]),
        (layer.self_attn.qkv_proj, torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])),
        (model.lm_head, stored["model.embed_tokens.weight" if ggml_type == Q8_0 else "lm_head.weight"]),
    ]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for module, weight in cases:
        (run,) = module.gguf_runs
        assert isinstance(run, (_Blocks, _Packed))
        if isinstance(run, _Blocks) and gguf_kernel.block_kernel(Q8_0) is not None:  # every format has a C kernel
            assert run.kernel is not None
        # well under float32; a type packed as two nibbles keeps its blocks beside them too
        split = isinstance(run, _Packed) and run.input_repeats == 2
        assert run.nbytes < weight.numel() * 4 / (1.7 if split else 2.5)
        x_in = x if weight.shape[1] == 256 else torch.randn(3, weight.shape[1])
        expected = x_in @ weight.T
        error = (module(x_in) - expected).norm() / expected.norm()
        assert error < RELATIVE_ERROR, (module.prefix, float(error))
        if isinstance(run, _Blocks) or run.dense is not None:  # prefill-sized: the float product
            # a block kernel runs its fast product below BLOCK_KERNEL_MAX_ROWS (decode batches)
            rows = BLOCK_KERNEL_MAX_ROWS if isinstance(run, _Blocks) and run.kernel is not None else DENSE_MIN_ROWS
            many = torch.randn(rows, weight.shape[1])
            torch.testing.assert_close(module(many), many @ weight.T, atol=1e-4, rtol=1e-4)
        one = torch.randn(1, weight.shape[1])
        with ops.exact_products():  # a step that carries prompt tokens: the float product at any rows
            torch.testing.assert_close(module(one), one @ weight.T, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_and_top5_logprobs_equal_transformers_on_the_dequantized_model(gguf_checkpoint) -> None:
    ggml_type, path, dequantized, _ = gguf_checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.config.quantization == "gguf"
    rng = torch.Generator().manual_seed(TYPES.index(ggml_type))
    prompts = [torch.randint(100, 49152, (n,), generator=rng).tolist() for n in (5, 17, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        expected, rows = transformers_greedy(oracle, prompt, 8)
        got = output.outputs[0].token_ids
        for step, (token, logprobs) in enumerate(zip(got, output.outputs[0].logprobs)):
            for token_id, logprob in logprobs.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - float(rows[step][token_id])) < LOGPROB_ATOL, (step, token_id)
            if token != expected[step]:  # only where the oracle's top two are a near tie; the rest differs from here
                top2 = rows[step].topk(2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE, (step, token, expected[step])
                break



def test_a_mixed_recipe_gives_each_tensor_its_type(tmp_path: Path) -> None:
    """Q4_K_M as llama.cpp mixes it: Q6_K for the head and, on the layers it gives more bits,
    the value and down projections; a fused projection of two types runs as two runs."""
    from sonar_models.formats.gguf_metadata import open_gguf

    folder = build_tiny_model("llama", tmp_path / "hf", num_hidden_layers=8, **SHAPE)
    write_gguf(folder, tmp_path / "model.gguf", "Q4_K_M")
    types = {t.name: int(t.tensor_type) for t in open_gguf(tmp_path / "model.gguf").tensors}
    assert types["output.weight"] == Q6_K
    more_bits = [layer for layer in range(8) if types[f"blk.{layer}.attn_v.weight"] == Q6_K]
    assert more_bits == [layer for layer in range(8) if types[f"blk.{layer}.ffn_down.weight"] == Q6_K] == [0, 3, 6, 7]
    assert {types[f"blk.{layer}.attn_q.weight"] for layer in range(8)} == {Q4_K}
    model = load_sonar_model(tmp_path / "model.gguf")
    assert len(model.model.layers[0].self_attn.qkv_proj.gguf_runs) == 2  # q, k in Q4_K; v in Q6_K
    assert len(model.model.layers[1].self_attn.qkv_proj.gguf_runs) == 1
    # a width K-quants cannot take (o_proj's 4 heads x 32 = 128 inputs): llama.cpp's fallback, Q5_0
    narrow = build_tiny_model("llama", tmp_path / "narrow", head_dim=32, **SHAPE)
    write_gguf(narrow, tmp_path / "narrow.gguf", "Q4_K_M")
    types = {t.name: int(t.tensor_type) for t in open_gguf(tmp_path / "narrow.gguf").tensors}
    assert types["blk.0.attn_output.weight"] == Q5_0 and types["blk.0.attn_q.weight"] == Q4_K


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_platform_without_int4_kernels_runs_the_dequantizing_path(gguf_checkpoint) -> None:
    ggml_type, path, _, stored = gguf_checkpoint
    from sonar_models.formats.gguf_file import raw_blocks
    from sonar_models.formats.gguf_metadata import open_gguf

    tensor = next(t for t in open_gguf(path).tensors if t.name == "blk.0.ffn_down.weight")
    blocks = raw_blocks(tensor)
    run = _Blocks(type(blocks)(blocks.ggml_type, blocks.rows, blocks.cols, blocks.data.cuda()))
    x = torch.randn(3, blocks.cols)
    expected = x @ stored["model.layers.0.mlp.down_proj.weight"].T
    torch.testing.assert_close(run(x.cuda()).cpu(), expected, atol=1e-4, rtol=1e-4)
