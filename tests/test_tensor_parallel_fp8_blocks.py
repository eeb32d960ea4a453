"""The block-fp8 layout and ``quantization="fp8"`` at tensor_parallel_size=2 (two real worker
processes over gloo) give the greedy tokens of one device, logprobs within float32 summation
error: block scales are cut by whole 128 x 128 blocks (a cut inside one is refused at load),
and an online FP8 weight is quantized whole (one scale per full row) before it is cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar.distributed import Communicator, ParallelGroup, building_for
from sonar.quantization import building_with
from sonar.quantization.fp8 import Fp8Method
from sonar_models.layers import Linear
from sonar_models.testing import build_tiny_model
from test_quant_fp8 import per_block, write_checkpoint
from tp_compare import assert_same_greedy_run, two_ranks_and_one_device

# every fused part's rows per rank (q, k, v 128; gate, up 256) a multiple of the 128-row blocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2)
EXACT = 1e-4  # the same FP8 products on each rank, summed in another order
#: Activations are quantized to FP8 per token and 128-wide group as they enter each product, so
#: the float32 rounding that the all-reduce's order leaves in the residual stream can move one
#: activation across an FP8 rounding boundary (a step of 1/16 of its magnitude); such a flip
#: moves logprobs by up to about 0.1 (seen on the CPU: 1 prompt in 6). A scale block cut wrong
#: would move them by whole nats and change the greedy tokens, which stay compared exactly.
FP8_ACTIVATION_FLIP = 0.15


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tp-fp8-blocks") / "llama", **SHAPE)


def test_block_scales(tiny: Path, tmp_path: Path) -> None:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": None}
    quantized, _ = write_checkpoint(tiny, tmp_path, per_block, config)
    assert_same_greedy_run(*two_ranks_and_one_device(str(quantized)), FP8_ACTIVATION_FLIP)


def test_online_fp8_quantizes_each_row_whole(tiny: Path) -> None:
    assert_same_greedy_run(*two_ranks_and_one_device(str(tiny), quantization="fp8"), EXACT)


def test_a_cut_inside_a_scale_block_is_refused() -> None:
    method = Fp8Method(serialized=True, block=(128, 128), static_activations=False, ignore=[])
    with building_for(ParallelGroup(1, 2, Communicator(2))), building_with(method):
        layer = Linear(256, 128, bias=False, prefix="model.layers.0.mlp.down_proj", parallel="column")
    assert layer.shard_checkpoint_tensor("weight", torch.zeros(128, 256, dtype=torch.float8_e4m3fn), None).shape == (64, 256)
    with pytest.raises(ValueError, match=r"down_proj: tensor_parallel_size=2 gives each rank 64 output rows, which splits the FP8 scale block of 128"):
        layer.shard_checkpoint_tensor("weight_scale_inv", torch.ones(1, 2), None)

