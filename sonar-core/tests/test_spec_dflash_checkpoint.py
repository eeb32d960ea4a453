"""DFlash / DSpark checkpoints without an engine: folders written here in each published layout
(z-lab's ``*-DFlash-b16``, DeepSpec's ``dflash_*_block7`` and ``dspark_*_block7``, scaled down)
load; malformed ones are refused naming the field or tensor; the method is detected from the
folder; what ``save_dflash`` writes is exactly the published layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar.spec_decode.detect import detect_method
from sonar.spec_decode.dflash_checkpoint import load_dflash, save_dflash
from sonar.spec_decode.dflash_config import read_dflash_config
from sonar.spec_decode.interface import SpeculativeConfig

# z-lab/Qwen3-8B-DFlash-b16 scaled down: hidden 64, 4 heads of 16, 2 KV heads, 2 draft layers
ZLAB = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2,
    "num_target_layers": 6, "block_size": 5, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "attention_bias": False,
    "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 3]}, "tie_word_embeddings": False,
}  # fmt: skip
# deepseek-ai/dspark_qwen3_8b_block7 scaled down (a copy of the target's Qwen3 config plus DeepSpec's fields)
DEEPSPEC = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2,
    "num_target_layers": 6, "block_size": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "attention_bias": False,
    "layer_types": ["full_attention", "full_attention"], "target_layer_ids": [-1, 2, 4], "mask_token_id": 299,
    "num_anchors": 512, "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "tie_word_embeddings": False,
}  # fmt: skip


def layer_shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }  # fmt: skip
    return shapes


def zlab_shapes() -> dict[str, tuple[int, ...]]:
    return layer_shapes() | {"fc.weight": (64, 2 * 64), "hidden_norm.weight": (64,), "norm.weight": (64,)}


def deepspec_shapes(markov: str | None = "vanilla", confidence: bool = True, rank: int = 8) -> dict[str, tuple[int, ...]]:
    shapes = layer_shapes() | {"fc.weight": (64, 3 * 64), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    shapes |= {"embed_tokens.weight": (300, 64), "lm_head.weight": (300, 64)}
    if markov:
        shapes |= {"markov_head.markov_w1.weight": (300, rank), "markov_head.markov_w2.weight": (300, rank)}
    if markov == "gated":
        shapes |= {"markov_head.gate_proj.weight": (rank, 64 + rank), "markov_head.gate_proj.bias": (rank,)}
    if markov == "rnn":
        shapes |= {"markov_head.joint_proj.weight": (3 * rank, 2 * rank + 64), "markov_head.joint_proj.bias": (3 * rank,)}
    if confidence:
        shapes |= {"confidence_head.proj.weight": (1, 64 + (rank if markov else 0)), "confidence_head.proj.bias": (1,)}
    return shapes


def write(folder, config: dict, shapes: dict[str, tuple[int, ...]], seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    save_file({name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}, str(folder / "model.safetensors"))
    return folder


def test_a_zlab_checkpoint_loads_with_its_fields_and_weights(tmp_path):
    folder = write(tmp_path / "zlab", ZLAB, zlab_shapes())
    drafter = load_dflash(folder)
    config = drafter.config
    assert (config.layout, config.block_size, config.num_drafts, config.first_slot) == ("zlab", 5, 4, 1)
    assert config.target_layer_ids == (1, 3) and config.aux_layer_ids == (2, 4) and config.mask_token_id == 299
    assert drafter.markov_head is None and drafter.confidence_head is None
    stored = load_file(str(folder / "model.safetensors"))
    assert set(drafter.state_dict()) == set(stored)
    assert torch.equal(drafter.layers[1].self_attn.k_norm.weight, stored["layers.1.self_attn.k_norm.weight"])
    assert detect_method(str(folder)) == "dflash"


def test_zlab_target_layers_default_to_an_even_spread(tmp_path):
    raw = json.loads(json.dumps(ZLAB))
    raw["num_target_layers"], raw["num_hidden_layers"] = 36, 5
    del raw["dflash_config"]["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_dflash_config(tmp_path).target_layer_ids == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B choice


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_a_deepspec_dspark_checkpoint_loads_its_heads_and_leaves_embedding_and_head_to_the_target(tmp_path, markov):
    folder = write(tmp_path / markov, {**DEEPSPEC, "markov_head_type": markov}, deepspec_shapes(markov))
    drafter = load_dflash(folder)
    config = drafter.config
    assert (config.layout, config.num_drafts, config.first_slot, config.aux_layer_ids) == ("deepspec", 4, 0, (0, 3, 5))
    assert config.is_dspark and drafter.markov_head.kind == markov and drafter.confidence_head.proj.in_features == 72
    names = set(drafter.state_dict())
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert detect_method(str(folder)) == "dspark"


def test_a_deepspec_dflash_checkpoint_is_dflash(tmp_path):
    raw = {**DEEPSPEC, "markov_rank": 0, "enable_confidence_head": False}
    del raw["markov_head_type"], raw["confidence_head_with_markov"]
    folder = write(tmp_path / "dflash", raw, deepspec_shapes(None, confidence=False))
    drafter = load_dflash(folder)
    assert not drafter.config.is_dspark and drafter.markov_head is None
    assert detect_method(str(folder)) == "dflash"
    assert SpeculativeConfig.from_value({"model": str(folder)}).method == "dflash"
    assert SpeculativeConfig.from_value({"method": "auto", "model": str(folder), "num_speculative_tokens": 2}).method == "dflash"


@pytest.mark.parametrize(
    "config, drop, message",
    [
        (DEEPSPEC, "mask_token_id", "lacks mask_token_id"),
        (DEEPSPEC, "markov_head_type", "lacks markov_head_type"),
        (DEEPSPEC, "target_layer_ids", "lacks target_layer_ids"),
        (DEEPSPEC, "block_size", "lacks block_size"),
        (ZLAB, "dflash_config", "lacks dflash_config"),
    ],
)
def test_a_missing_config_field_is_refused_by_name(tmp_path, config, drop, message):
    raw = {k: v for k, v in config.items() if k != drop}
    if drop == "dflash_config":
        raw["architectures"] = ["DFlashDraftModel"]
    folder = write(tmp_path / "bad", raw, zlab_shapes() if config is ZLAB else deepspec_shapes())
    with pytest.raises(ValueError, match=message):
        load_dflash(folder)


def test_malformed_fields_and_tensors_are_refused_with_what_is_wrong(tmp_path):
    bad_mask = {**ZLAB, "dflash_config": {"target_layer_ids": [1, 3]}}
    with pytest.raises(ValueError, match="dflash_config.mask_token_id"):
        load_dflash(write(tmp_path / "nomask", bad_mask, zlab_shapes()))
    with pytest.raises(ValueError, match="mask_token_id 300 is outside the vocabulary of 300"):
        load_dflash(write(tmp_path / "mask", {**DEEPSPEC, "mask_token_id": 300}, deepspec_shapes()))
    with pytest.raises(ValueError, match="strictly increasing"):
        load_dflash(write(tmp_path / "order", {**DEEPSPEC, "target_layer_ids": [2, 1, 4]}, deepspec_shapes()))
    wrong_fc = zlab_shapes() | {"fc.weight": (64, 3 * 64)}
    with pytest.raises(ValueError, match=r"fc.weight is \[64, 192\], expected \[64, 128\]"):
        load_dflash(write(tmp_path / "fc", ZLAB, wrong_fc))
    wrong_vocab = deepspec_shapes() | {"lm_head.weight": (320, 64)}
    with pytest.raises(ValueError, match=r"lm_head.weight is \[320, 64\], expected \[vocab_size, hidden_size\] = \[300, 64\]"):
        load_dflash(write(tmp_path / "vocab", DEEPSPEC, wrong_vocab))
    no_markov = {k: v for k, v in deepspec_shapes().items() if not k.startswith("markov_head.markov_w2")}
    with pytest.raises(ValueError, match=r"missing \['markov_head.markov_w2.weight'\]"):
        load_dflash(write(tmp_path / "nomarkov", DEEPSPEC, no_markov))
    with pytest.raises(ValueError, match="no config.json"):
        load_dflash(tmp_path / "absent")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not a DFlash or DSpark drafter config"):
        load_dflash(tmp_path / "llama")
    assert detect_method(str(tmp_path / "llama")) == "draft_model"


@pytest.mark.parametrize("layout", ["zlab", "deepspec"])
def test_save_writes_the_published_layout_and_reloads_equal(tmp_path, layout):
    if layout == "zlab":
        source, shapes = write(tmp_path / "src", ZLAB, zlab_shapes()), zlab_shapes()
    else:
        source, shapes = write(tmp_path / "src", DEEPSPEC, deepspec_shapes()), deepspec_shapes()
    drafter = load_dflash(source)
    stored = load_file(str(source / "model.safetensors"))
    out = save_dflash(drafter, tmp_path / "out", embedding=stored.get("embed_tokens.weight"), lm_head=stored.get("lm_head.weight"))
    written = load_file(str(out / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in written.items()} == shapes
    raw = json.loads((out / "config.json").read_text())
    original = ZLAB if layout == "zlab" else DEEPSPEC
    for key in ("architectures", "block_size", "num_target_layers", "hidden_size", "vocab_size"):
        assert raw[key] == original[key]
    if layout == "zlab":
        assert raw["dflash_config"] == ZLAB["dflash_config"]
    else:
        for key in ("target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
            assert raw[key] == DEEPSPEC[key]
    again = load_dflash(out)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="deepspec layout stores the target's"):
        save_dflash(drafter, tmp_path / "nohead", layout="deepspec")
