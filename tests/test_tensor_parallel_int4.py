"""GPTQ (in activation order), AWQ and GGUF checkpoints at tensor_parallel_size=2 (two real
worker processes over gloo) give the greedy tokens of one device. A row-parallel GPTQ rank in
activation order keeps every group's scales and each input's own group (its columns draw on
all of them); a cut that would split a group or a GGUF block is refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from int4_quantizer import write_int4_checkpoint
from sonar.distributed import Communicator, ParallelGroup, building_for
from sonar.quantization import building_with
from sonar.quantization.awq import AWQMethod
from sonar_models.formats.gguf_blocks import Q4_K, Q6_K, Q8_0, GGUFBlocks
from sonar_models.formats.gguf_quant import GGUFMethod
from sonar_models.formats.gguf_quantize import write_gguf
from sonar_models.layers import Linear
from sonar_models.testing import build_tiny_model
from tp_compare import assert_same_greedy_run, two_ranks_and_one_device

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2)
EXACT = 1e-4  # the same dequantized products on each rank, summed in another order
# Q8_0 decodes through the CPU's int4 kernel, which rounds each product to bfloat16: the ranks'
# partial sums round apart, so logprobs move by a bfloat16 step (1/32 nat at these logits) and
# greedy may part where one device's top two are that close
BF16_KERNEL_ATOL = 0.07
BF16_NEAR_TIE = 0.07


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tp-int4") / "llama", **SHAPE)


@pytest.mark.parametrize(
    "variant", [dict(fmt="gptq", group_size=64, sym=False, desc_act=True), dict(fmt="awq", group_size=128)], ids=["gptq-act-order", "awq"]
)
def test_int4_checkpoint(tiny: Path, tmp_path: Path, variant: dict) -> None:
    quantized, _ = write_int4_checkpoint(tiny, tmp_path, **variant)
    assert_same_greedy_run(*two_ranks_and_one_device(str(quantized)), EXACT)


def test_gguf_q6_k_blocks(tmp_path: Path) -> None:
    # 256-value blocks: every rank's inputs (256 of o_proj, 512 of down_proj) hold whole ones
    folder = build_tiny_model("llama", tmp_path / "hf", hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    write_gguf(folder, tmp_path / "model.gguf", Q6_K)
    assert_same_greedy_run(*two_ranks_and_one_device(str(tmp_path / "model.gguf"), skip_tokenizer_init=True), EXACT)


def test_gguf_q8_0_tied_head_through_the_int4_kernel(tmp_path: Path) -> None:
    folder = build_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=True, **SHAPE)
    write_gguf(folder, tmp_path / "model.gguf", Q8_0, quantize_embedding=True)
    expected, got = two_ranks_and_one_device(str(tmp_path / "model.gguf"), skip_tokenizer_init=True)
    assert_same_greedy_run(expected, got, BF16_KERNEL_ATOL, near_tie=BF16_NEAR_TIE)


def _rank_layer(method, in_features: int, out_features: int) -> Linear:
    with building_for(ParallelGroup(1, 2, Communicator(2))), building_with(method):
        return Linear(in_features, out_features, bias=False, prefix="model.layers.0.mlp.down_proj", parallel="row")


def test_a_quantized_vocabulary_is_padded_with_zero_blocks() -> None:
    with building_for(ParallelGroup(1, 2, Communicator(2))), building_with(GGUFMethod()):
        head = Linear(64, 1001, bias=False, prefix="lm_head", parallel="column")
    table = GGUFBlocks(Q8_0, 1001, 64, torch.randint(1, 255, (1001, 68), dtype=torch.uint8))
    ours = head.shard_checkpoint_tensor("weight", table, None)
    assert ours.shape == (501, 64)  # rows 501..1001 of 1002, the last one padding
    assert torch.equal(ours.data[:500], table.data[501:]) and not ours.data[500].any()


def test_a_cut_inside_a_group_or_block_is_refused() -> None:
    with pytest.raises(ValueError, match=r"down_proj: tensor_parallel_size=2 gives each rank 64 input columns, which splits the awq group of 128"):
        _rank_layer(AWQMethod(group_size=128), 128, 64)
    layer = _rank_layer(GGUFMethod(), 256, 64)
    blocks = GGUFBlocks(Q4_K, 64, 256, torch.zeros(64, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"gives each rank 128 input columns, which splits the GGUF Q4_K block of 256"):
        layer.shard_checkpoint_tensor("weight", blocks, None)
