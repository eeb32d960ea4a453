"""GGUF files of every architecture the reader maps, written as llama.cpp's converter writes
them (Gemma's norms stored as ``1 + w``, Phi-3's fused q/k/v and gate/up, its LongRoPE factors
as tensors, Gemma 2's caps and window in the metadata): the config read back equals the one
written, the dequantized model's logits equal transformers' on the same weights, and the
natively quantized model generates transformers' greedy tokens."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from sonar import LLM, SamplingParams, ops
from sonar_models.formats import GGUFFormat
from sonar_models.formats.gguf_blocks import Q4_0, Q8_0, TYPE_NAMES
from sonar_models.formats.gguf_metadata import GGUF_ARCHITECTURES, open_gguf
from sonar_models.formats.gguf_quantize import write_gguf
from sonar_models.testing import PagedCacheDriver, build_tiny_model, load_sonar_model

#: tiny configs as llama.cpp can state them: Gemma's score scale is 1/sqrt(head_dim) outside
#: the 27B models, and Gemma 3 slides five layers of six
ARCHS = {
    "qwen2": {},  # q/k/v biases, tied embedding
    "qwen3": {},  # per-head q/k norms, explicit head_dim
    "qwen3_moe": dict(mlp_only_layers=[]),  # 8 experts in every layer, 2 chosen and renormalised
    "qwen2_moe": dict(shared_expert_intermediate_size=64),  # 4 experts, 2 chosen, not renormalised; a gated shared expert (rows in whole blocks)
    "phi3": {},  # fused q/k/v and gate/up, half the head rotated, LongRoPE
    "gemma2": dict(query_pre_attn_scalar=32),  # window 8, caps on scores (1.0) and logits (3.0)
    "gemma3": dict(query_pre_attn_scalar=32, num_hidden_layers=6, sliding_window_pattern=6),  # q/k norms, linear rope on global layers
}
#: nats: decode steps run the CPU's quantized kernels, which round their activations (to int8
#: blocks for Q8_0, to bfloat16 for Q4_0); Gemma 3 needs six layers for one global layer and
#: its tiny logits span twice as wide, so its error is larger; a router whose top experts are
#: near a tie may choose another expert from rounded activations (the dequantized model is
#: checked exactly, the products within 2%)
LOGPROB_ATOL = {"gemma3": 0.45, "qwen3_moe": 0.5, "qwen2_moe": 0.5}
DEFAULT_LOGPROB_ATOL = 0.2
RELATIVE_ERROR = 0.02  # of a layer's output against the product of the weights the file holds
NEAR_TIE = 0.2  # nats between the oracle's top two tokens: greedy may pick either


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    from sonar_cpu import quant_ops

    ops.register_ops("cpu", quant_ops.OPS)
    yield
    ops.unregister_ops("cpu")


#: widths K-quants take (multiples of 256), for the mixture-of-experts file in llama.cpp's Q4_K_M
#: recipe (Q4_K experts; the second layer's down projections, and the head, in Q6_K)
K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CHECKPOINTS = [(arch, kind) for arch in ARCHS for kind in (Q8_0, Q4_0)] + [("qwen3_moe", "Q4_K_M")]


def _kind_name(kind: int | str) -> str:
    return kind if isinstance(kind, str) else TYPE_NAMES[kind]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda p: f"{p[0]}-{_kind_name(p[1])}")
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """``(arch, original folder, .gguf file, folder of the weights as the file holds them)``."""
    arch, kind = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{_kind_name(kind)}")
    shape = K_QUANT_SHAPE if isinstance(kind, str) else {}
    folder = build_tiny_model(arch, root / "hf", **{**ARCHS[arch], **shape})
    path = root / "model.gguf"
    stored = write_gguf(folder, path, kind, quantize_embedding=kind == Q8_0)  # Q8_0: the tied head reads the quantized table
    dequantized = root / "dequantized"
    shutil.copytree(folder, dequantized)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(dequantized / "model.safetensors"))
    return arch, folder, path, dequantized


def _rope(config) -> dict:
    return {k: [round(x, 5) for x in v] if isinstance(v, list) else v for k, v in (config.rope_parameters or {}).items()}


def test_the_config_read_back_is_the_one_written(checkpoint) -> None:
    arch, folder, path, _ = checkpoint
    written, read = AutoConfig.from_pretrained(folder), GGUFFormat().load_hf_config(path)
    assert read.architectures == written.architectures
    assert any(m.hf_architecture == read.architectures[0] for m in GGUF_ARCHITECTURES.values())
    fields = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps",
              "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "decoder_sparse_step"]
    for name in fields:
        if hasattr(written, name):
            assert getattr(read, name) == pytest.approx(getattr(written, name)), name
    if arch == "gemma3":
        assert {k: _rope_dict(v) for k, v in read.rope_parameters.items()} == {k: _rope_dict(v) for k, v in written.rope_parameters.items()}
    else:
        expected = _rope(written)
        got = _rope(read)
        if arch == "phi3":  # the file states the LongRoPE attention factor transformers derives
            factor = written.max_position_embeddings / written.original_max_position_embeddings
            assert got.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(written.original_max_position_embeddings)))
        assert got == expected


def _rope_dict(params: dict) -> dict:
    return {"rope_type": params.get("rope_type", "default"), **params}


def test_dequantized_logits_equal_transformers_on_the_weights_in_the_file(checkpoint) -> None:
    _, _, path, dequantized = checkpoint
    prompt = torch.randint(100, 49152, (21,), generator=torch.Generator().manual_seed(0)).tolist()  # past the window of 8
    oracle = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = oracle(torch.tensor([prompt])).logits[0].float()
    model = load_sonar_model(path, quantization="unquantized")
    logits = model.compute_logits(PagedCacheDriver(model).step(model, [(0, prompt)]))
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)


def test_native_layers_stay_quantized_and_multiply_like_the_weights_in_the_file(checkpoint) -> None:
    _, _, path, dequantized = checkpoint
    from safetensors.torch import load_file

    stored = load_file(str(dequantized / "model.safetensors"))
    model = load_sonar_model(path)
    layer = model.model.layers[0]
    dense_mlp = hasattr(layer.mlp, "gate_up_proj")
    weight = lambda *names: torch.cat([stored[f"model.layers.0.{n}.weight"] for n in names if f"model.layers.0.{n}.weight" in stored])  # noqa: E731
    biases = [stored[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv" if f"model.layers.0.self_attn.{p}_proj.bias" in stored]
    cases = [
        (layer.self_attn.qkv_proj, weight("self_attn.qkv_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), torch.cat(biases) if biases else 0),
        (layer.self_attn.o_proj, weight("self_attn.o_proj"), 0),
    ]
    if dense_mlp:
        cases += [(layer.mlp.gate_up_proj, weight("mlp.gate_up_proj", "mlp.gate_proj", "mlp.up_proj"), 0), (layer.mlp.down_proj, weight("mlp.down_proj"), 0)]
    elif layer.mlp.shared_expert is not None:
        shared = layer.mlp.shared_expert
        cases += [(shared.gate_up_proj, weight("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), 0), (shared.down_proj, weight("mlp.shared_expert.down_proj"), 0)]
    for module, expected_weight, bias in cases:
        assert module.gguf_runs, module.prefix
        assert sum(run.nbytes for run in module.gguf_runs) < expected_weight.numel() * 4 / 2.5, module.prefix
        x = torch.randn(3, expected_weight.shape[1], generator=torch.Generator().manual_seed(0))
        expected = x @ expected_weight.T + bias  # Qwen2's q/k/v biases
        error = (module(x) - expected).norm() / expected.norm()
        assert error < RELATIVE_ERROR, (module.prefix, float(error))


def test_experts_stay_quantized_on_the_cpu_and_dequantize_once_for_the_fused_kernel(checkpoint) -> None:
    """Each expert keeps its blocks and multiplies like the file's weights; the path a GPU takes
    (every expert dequantized into the fused kernel's stacked tensors) gives the same layer
    output as the blocks."""
    arch, _, path, dequantized = checkpoint
    if not arch.endswith("_moe"):
        pytest.skip("a dense architecture")
    from safetensors.torch import load_file

    from sonar_models.formats.gguf_quant import GGUFExpertsMethod, run_rows

    stored = load_file(str(dequantized / "model.safetensors"))
    model = load_sonar_model(path)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.method, GGUFExpertsMethod) and len(experts.gguf_experts) == experts.num_experts
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for e in (0, experts.num_experts - 1):
        gate_up, down = experts.gguf_experts[e]
        weight = torch.cat([stored[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
        for runs, w, inputs in ((gate_up, weight, x), (down, stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], torch.randn(5, weight.shape[0] // 2))):
            assert sum(run.nbytes for run in runs) < w.numel() * 4 / 2.5
            expected = inputs @ w.T
            assert (run_rows(runs, inputs) - expected).norm() / expected.norm() < RELATIVE_ERROR
    topk_weights, topk_ids = model.model.layers[0].mlp.route(x)
    native = experts(x, topk_weights, topk_ids)
    assert experts.gguf_batched is not None  # Q8_0, Q4_0 and K-quant experts: the C kernel takes them all in one call
    batched, experts.gguf_batched = experts.gguf_batched, None
    torch.testing.assert_close(experts(x, topk_weights, topk_ids), native, atol=1e-5, rtol=1e-5)  # one call per expert: the same
    experts.gguf_batched = batched
    from sonar_models.formats.gguf_file import expert_blocks
    from sonar_models.formats.gguf_metadata import open_gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}
    parts = [expert_blocks(tensors[f"blk.0.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down")]
    experts.gguf_experts = [tuple(kind[e] for kind in parts) for e in range(experts.num_experts)]
    GGUFExpertsMethod()._dequantize(experts)
    assert experts.gguf_experts is None and experts.w13.shape == (experts.num_experts, 2 * experts.intermediate_size, x.shape[1])
    torch.testing.assert_close(experts(x, topk_weights, topk_ids), native, atol=0.02 * float(native.abs().max()), rtol=0)


def test_native_greedy_tokens_and_logprobs_equal_transformers(checkpoint) -> None:
    arch, _, path, dequantized = checkpoint
    atol = LOGPROB_ATOL.get(arch, DEFAULT_LOGPROB_ATOL)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.config.quantization == "gguf"
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 49152, (n,), generator=rng).tolist() for n in (5, 17, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    oracle = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        tokens, rows = list(prompt), []
        with torch.no_grad():
            for _ in range(8):
                rows.append(oracle(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1))
                tokens.append(int(rows[-1].argmax()))
        expected = tokens[len(prompt):]
        got = output.outputs[0]
        for step, (token, logprobs) in enumerate(zip(got.token_ids, got.logprobs)):
            for token_id, logprob in logprobs.items():
                assert abs(logprob.logprob - float(rows[step][token_id])) < atol, (step, token_id)
            if token != expected[step]:  # only where the oracle's top two are a near tie; the rest differs from here
                top2 = rows[step].topk(2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE, (step, token, expected[step])
                break


def test_gemma_norms_are_stored_as_llama_cpp_stores_them(checkpoint) -> None:
    arch, folder, path, _ = checkpoint
    if not arch.startswith("gemma"):
        pytest.skip("only Gemma's norms are shifted")
    from safetensors.torch import load_file

    original = load_file(str(folder / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    tensor = next(t for t in open_gguf(path).tensors if t.name == "blk.0.attn_norm.weight")
    torch.testing.assert_close(torch.from_numpy(tensor.data.copy()), original.float() + 1)


def test_a_config_llama_cpp_cannot_state_is_refused(tmp_path) -> None:
    folder = build_tiny_model("gemma2", tmp_path / "hf")  # query_pre_attn_scalar 24, head_dim 32
    with pytest.raises(NotImplementedError, match="query_pre_attn_scalar=24"):
        write_gguf(folder, tmp_path / "model.gguf", Q8_0)
    folder = build_tiny_model("qwen3_moe", tmp_path / "moe")  # layer 1 dense (mlp_only_layers)
    with pytest.raises(NotImplementedError, match="dense layers"):
        write_gguf(folder, tmp_path / "moe.gguf", Q8_0)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "qwen3_moe"])
def test_a_file_with_a_tokenizer_serves_text(arch: str, tmp_path) -> None:
    """The file's own tokenizer (SmolLM2's, copied in) is what ``LLM`` tokenizes text with,
    chat template included, whatever the architecture's name in the file."""
    from sonar_models.formats.gguf_tokenizer import load_gguf_tokenizer
    from sonar_models.testing import smollm2_gguf_path, smollm2_tokenizer

    folder = build_tiny_model(arch, tmp_path / "hf", **ARCHS[arch])
    path = tmp_path / "model.gguf"
    write_gguf(folder, path, Q8_0, tokenizer_from=smollm2_gguf_path())
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    tokenizer, reference = llm.get_tokenizer(), smollm2_tokenizer()
    text = "The capital of France is Paris. Ünïcödé, 12345 tokens!"
    assert tokenizer.encode(text) == reference.encode(text)
    again = load_gguf_tokenizer(path)  # a second load: from the cache where the first one was kept
    assert again.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(messages, tokenize=False)
    output = llm.generate([text], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(output.token_ids) == 4 and output.text == tokenizer.decode(output.token_ids)
