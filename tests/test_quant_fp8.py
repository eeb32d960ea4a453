"""FP8 W8A8 checkpoints in their real layouts, written by a small quantizer here, run through
``LLM`` greedy-equal to transformers on the dequantized weights.

The layouts: compressed-tensors per-tensor weights with static activation scales (scales in
bf16, as llm-compressor writes them; q/k/v with different scales), compressed-tensors
per-channel weights with dynamic per-token activations, the Hugging Face ``fp8`` layout with
128 x 128 block scales (``weight_scale_inv``) and per-token-group activations, and
``quantization="fp8"`` quantizing a float checkpoint at load.

The oracle is transformers on the dequantized weights with each linear layer's input put
through the same FP8 activation quantization (a forward pre-hook): greedy tokens equal token
for token, top-5 log-probabilities within ``EMULATED_ATOL`` (float32; what is left is the
order of float32 sums). Against transformers without the activation quantization, the
first step's top-5 log-probabilities stay within ``UNEMULATED_RTOL`` (relative): the
perturbation that FP8 activations alone cause on these tiny random models (up to 5.4% measured).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HFOracle, random_prompts
from sonar import LLM, SamplingParams
from sonar.quantization.fp8 import (
    FP8_DTYPE,
    dequantize_blocks,
    fake_quantize_per_group,
    fake_quantize_per_token,
    per_token_scale,
    quantize_per_row,
    to_fp8,
)
from sonar_models.testing import build_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMULATED_ATOL = 2e-3
UNEMULATED_RTOL = 0.1
NUM_TOKENS = 8
BLOCK = 128

Quantizer = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]  # (weight name, weight) -> tensors


# -- the quantizer -----------------------------------------------------------------------


def per_tensor(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (weight.abs().amax() / 448.0).to(torch.bfloat16).reshape(1)
    return {name: to_fp8(weight, scale.float()), f"{name}_scale": scale}


def per_channel(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quantize_per_row(weight)
    return {name: q, f"{name}_scale": scale[:, None]}


def per_block(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    blocks = weight.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = to_fp8(blocks, scale[:, None, :, None]).reshape(n, k)
    return {name: q, f"{name}_scale_inv": scale}


def dequantize(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    q = tensors[name]
    if f"{name}_scale_inv" in tensors:
        return dequantize_blocks(q, tensors[f"{name}_scale_inv"], (BLOCK, BLOCK))
    scale = tensors[f"{name}_scale"].float()
    return q.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)


def calibrated_input_scales(folder: Path) -> dict[str, float]:
    """Static activation scales as a calibration run gives them: amax / 448 of each projection's
    input over a few prompts (k_proj's raised by a quarter, so q/k/v differ as they do in real
    checkpoints and the fused layer must take the largest)."""
    oracle = HFOracle(folder)
    amax: dict[str, float] = {}
    hooks = []
    for name, module in oracle.model.named_modules():
        if name.endswith(PROJECTIONS):
            def record(module, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(record))
    with torch.inference_mode():
        for prompt in random_prompts(4, seed=3, max_len=40):
            oracle.model(input_ids=torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return {name: value / 448.0 * (1.25 if name.endswith("k_proj") else 1.0) for name, value in amax.items()}


def write_checkpoint(source: Path, root: Path, quantizer: Quantizer, quant_config: dict, input_scales: dict[str, float] | None = None) -> tuple[Path, Path]:
    """``(quantized folder, dequantized float folder)`` of the model at ``source``."""
    quantized, dequantized = root / "quantized", root / "dequantized"
    for folder in (quantized, dequantized):
        shutil.copytree(source, folder, dirs_exist_ok=True)
    float_tensors = load_file(str(source / "model.safetensors"))
    quantized_tensors: dict[str, torch.Tensor] = {}
    for name, tensor in float_tensors.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            written = quantizer(name, tensor.float())
            quantized_tensors.update(written)
            float_tensors[name] = dequantize(written, name).to(tensor.dtype)
            if input_scales is not None:
                quantized_tensors[name.replace(".weight", ".input_scale")] = torch.tensor([input_scales[name[: -len(".weight")]]], dtype=torch.bfloat16)
        else:
            quantized_tensors[name] = tensor
    save_file(quantized_tensors, str(quantized / "model.safetensors"))
    save_file(float_tensors, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = quant_config
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dequantized


def compressed_tensors_config(weight_strategy: str, static_activations: bool) -> dict:
    """``quantization_config`` as llm-compressor writes it for an FP8 scheme."""
    def args(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic, "group_size": None, "block_structure": None, "actorder": None, "observer": observer, "observer_kwargs": {}}

    inputs = args("tensor", False, "minmax") if static_activations else args("token", True, None)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if static_activations or weight_strategy == "channel" else "naive-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args(weight_strategy, False, "minmax"), "input_activations": inputs, "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
        "global_compression_ratio": 1.5,
    }


# -- the oracle --------------------------------------------------------------------------


def emulate_activations(oracle: HFOracle, kind: str, input_scales: dict[str, float] | None = None) -> None:
    """Quantize each decoder projection's input as the FP8 scheme ``kind`` does."""
    for name, module in oracle.model.named_modules():
        if not name.endswith(PROJECTIONS):
            continue
        if kind == "static":
            siblings = [name.rsplit(".", 1)[0] + f".{p}" for p in (("q_proj", "k_proj", "v_proj") if "self_attn" in name and not name.endswith("o_proj") else ("gate_proj", "up_proj") if name.endswith(("gate_proj", "up_proj")) else (name.rsplit(".", 1)[1],))]
            scale = torch.tensor(max(float(torch.tensor(input_scales[s]).to(torch.bfloat16)) for s in siblings))
            fake = lambda x, scale=scale: to_fp8(x, scale).float() * scale
        elif kind == "token":
            fake = lambda x: fake_quantize_per_token(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        else:
            fake = lambda x: fake_quantize_per_group(x.reshape(-1, x.shape[-1]), BLOCK).reshape(x.shape)
        module.register_forward_pre_hook(lambda module, args, fake=fake: (fake(args[0]).to(args[0].dtype),))


def assert_runs_like_transformers(quantized: Path, dequantized: Path, kind: str, input_scales: dict[str, float] | None = None, **llm_options) -> None:
    llm = LLM(str(quantized), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, **llm_options)
    prompts = random_prompts(2, seed=8, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    plain = HFOracle(dequantized)
    emulated = HFOracle(dequantized)
    emulate_activations(emulated, kind, input_scales)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected, rows = emulated.greedy(prompt, NUM_TOKENS)
        assert completion.token_ids == expected
        _, plain_rows = plain.greedy(prompt, 1)
        for step, (row, logprobs) in enumerate(zip(rows, completion.logprobs)):
            top5 = torch.topk(row, 5).indices.tolist()
            got = torch.tensor([logprobs[t].logprob for t in top5])
            torch.testing.assert_close(got, row[top5], atol=EMULATED_ATOL, rtol=0)
            if step == 0:
                torch.testing.assert_close(got, plain_rows[0][top5], atol=0, rtol=UNEMULATED_RTOL)


# -- the layouts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("fp8") / "llama")


def test_compressed_tensors_per_tensor_weights_static_activations(tiny_llama: Path, tmp_path: Path) -> None:
    scales = calibrated_input_scales(tiny_llama)
    quantized, dequantized = write_checkpoint(tiny_llama, tmp_path, per_tensor, compressed_tensors_config("tensor", True), scales)
    tensors = load_file(str(quantized / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (1,)
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"] != tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    assert_runs_like_transformers(quantized, dequantized, "static", scales)


def test_compressed_tensors_per_channel_weights_dynamic_per_token_activations(tiny_llama: Path, tmp_path: Path) -> None:
    quantized, dequantized = write_checkpoint(tiny_llama, tmp_path, per_channel, compressed_tensors_config("channel", False))
    assert load_file(str(quantized / "model.safetensors"))["model.layers.1.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert_runs_like_transformers(quantized, dequantized, "token")


def test_hf_fp8_block_scales(tmp_path: Path) -> None:
    source = build_tiny_model("llama", tmp_path / "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": None}
    quantized, dequantized = write_checkpoint(source, tmp_path, per_block, config)
    assert load_file(str(quantized / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (4, 2)
    assert_runs_like_transformers(quantized, dequantized, "group")


def test_online_fp8_quantizes_a_float_checkpoint_at_load(tiny_llama: Path, tmp_path: Path) -> None:
    dequantized = tmp_path / "dequantized"
    shutil.copytree(tiny_llama, dequantized)
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            q, scale = quantize_per_row(tensor.float())
            tensors[name] = q.float() * scale[:, None]
    save_file(tensors, str(dequantized / "model.safetensors"))
    assert_runs_like_transformers(tiny_llama, dequantized, "token", quantization="fp8")


# -- refusals ----------------------------------------------------------------------------


def _with_config(tiny_llama: Path, tmp_path: Path, quant_config: dict) -> Path:
    folder = tmp_path / "refused"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
        ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "weights of 4 bits, type 'int'"),
        ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}, "input_activations": None}}}, "FP8 weight-only"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_refused_naming_what_is_supported(tiny_llama: Path, tmp_path: Path, change: dict, message: str) -> None:
    folder = _with_config(tiny_llama, tmp_path, {**compressed_tensors_config("channel", False), **change})
    with pytest.raises(ValueError, match=message) as error:
        LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20)
    assert "supported: FP8 W8A8" in str(error.value)


def test_a_float_weight_in_an_fp8_checkpoint_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    folder = _with_config(tiny_llama, tmp_path, compressed_tensors_config("channel", False))
    with pytest.raises(ValueError, match=r"_proj.weight' is torch.float32, but this FP8 layout stores weights as torch.float8_e4m3fn"):
        LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20)


def test_per_token_scale_of_a_zero_row_is_positive() -> None:
    x = torch.zeros(2, 8)
    x[1, 3] = -896.0
    scale = per_token_scale(x)
    assert scale[0, 0] > 0 and scale[1, 0] == 2.0
    assert torch.equal(to_fp8(x, scale).float() * scale, x)
