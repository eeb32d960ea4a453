"""Mixture-of-experts pieces: the grouped torch experts, routing variants against
transformers, and the checkpoint layouts the loader reads (the tiny MoE models' logits are
compared with transformers in test_llama_vs_hf.py with the dense ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sonar.moe import fused_moe, torch_fused_moe
from sonar_models.testing import PagedCacheDriver, build_tiny_model, load_sonar_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 1345, 314, 3119, 28, 5123, 17, 30, 2]


def per_token_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The definition, one token and one choice at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[expert] @ x[t]).chunk(2)
            out[t] += weight * (w2[expert] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_grouped_experts_equal_the_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(9, 16, generator=gen), torch.randn(5, 24, 16, generator=gen), torch.randn(5, 16, 12, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(9, 5, generator=gen), -1), 3, dim=-1)
    ids[0] = torch.tensor([4, 4, 4])  # one token choosing one expert several times still adds each choice
    expected = per_token_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch_fused_moe(x.double(), w13.double(), w2.double(), weights, ids.int()), expected.double(), atol=1e-5, rtol=1e-5)


def test_expert_shapes_that_do_not_fit_are_refused() -> None:
    x, w13, w2 = torch.randn(3, 16), torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    weights, ids = torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"must both be \[T=3, k\]"):
        fused_moe(x, w13, w2, weights[:2], ids[:2])


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def sonar_logits(path: Path, prompt: list[int], **load_kwargs) -> torch.Tensor:
    model = load_sonar_model(path, **load_kwargs)
    return model.compute_logits(PagedCacheDriver(model, block_size=4).step(model, [(0, prompt)]))


def test_qwen3_moe_sparse_step_and_unnormalised_weights_match_hf(tmp_path: Path) -> None:
    """Every second layer sparse (``decoder_sparse_step=2``), top-k probabilities as they are."""
    path = build_tiny_model("qwen3_moe", tmp_path / "step2", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)
    model = load_sonar_model(path)
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.model.layers]
    assert sparse == [False, True, False, True]
    assert not model.model.layers[1].mlp.renormalize
    torch.testing.assert_close(sonar_logits(path, PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_qwen3_moe_sliding_window_is_in_every_layer_as_in_hf(tmp_path: Path) -> None:
    """transformers slides every Qwen3-MoE layer when ``use_sliding_window`` (``max_window_layers`` unused)."""
    path = build_tiny_model("qwen3_moe", tmp_path / "window", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert load_sonar_model(path).sliding_windows == [6, 6]
    torch.testing.assert_close(sonar_logits(path, PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral") / "mixtral")


def test_transformers_stacked_layout_loads_like_the_per_expert_one(mixtral_dir: Path, tmp_path: Path) -> None:
    """transformers' in-memory names (``mlp.experts.gate_up_proj [E, 2I, H]``) read into the
    same parameters as the per-expert ``block_sparse_moe.experts.{e}.w1/w3/w2`` it saves."""
    hf = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (stacked / name).write_bytes((mixtral_dir / name).read_bytes())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, stacked / "model.safetensors")
    from_stacked, from_per_expert = load_sonar_model(stacked), load_sonar_model(mixtral_dir)
    for (name, a), (_, b) in zip(from_stacked.named_parameters(), from_per_expert.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in load_file(mixtral_dir / "model.safetensors")


def write_variant(source: Path, target: Path, change) -> Path:
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_a_missing_expert_is_named(mixtral_dir: Path, tmp_path: Path) -> None:
    path = write_variant(mixtral_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match=r"did not provide 1 parameters: model\.layers\.1\.mlp\.experts\.w13\[\(2, 'up'\)\]"):
        load_sonar_model(path)


def test_an_expert_beyond_the_config_is_refused(mixtral_dir: Path, tmp_path: Path) -> None:
    def add_expert(tensors: dict) -> None:
        tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()

    with pytest.raises(ValueError, match="expert 4 is out of range: the config has 4 experts per layer"):
        load_sonar_model(write_variant(mixtral_dir, tmp_path / "extra", add_expert))


def test_expert_with_a_wrong_shape_is_refused(mixtral_dir: Path, tmp_path: Path) -> None:
    def shrink(tensors: dict) -> None:
        name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
        tensors[name] = tensors[name][:, :64].contiguous()

    with pytest.raises(ValueError, match=r"experts\.1\.w2\.weight' has shape \(64, 64\), but the model expects \(64, 128\)"):
        load_sonar_model(write_variant(mixtral_dir, tmp_path / "shape", shrink))


def test_dummy_weights_by_name_load(mixtral_dir: Path) -> None:
    """``load_format="dummy"``'s named tensors come in transformers' stacked layout."""
    from sonar.model_interface import make_attention_factory
    from sonar.registry import resolve_model_class
    from sonar_models.formats import DummyFormat

    fmt = DummyFormat()
    config = fmt.load_hf_config(mixtral_dir)
    model = resolve_model_class(config)(config, make_attention_factory(None))
    model.load_weights(fmt.iter_weights(mixtral_dir, config))
    assert model.model.layers[0].mlp.experts.w13.std() > 0.01
