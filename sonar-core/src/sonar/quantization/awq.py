"""AWQ int4 checkpoints, GEMM version (AutoAWQ, as transformers loads them).

On disk, per quantized projection of ``in`` inputs and ``out`` outputs:

- ``qweight`` int32 ``[in, out / 8]``: 4-bit values packed along the output dim in AWQ's
  interleaved order (nibble ``i`` of a word holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its 8);
- ``qzeros`` int32 ``[groups, out / 8]``: zero points, packed the same way;
- ``scales`` float16 ``[groups, out]``.

``W[k, n] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]``. Loading repacks
into the runtime layout of ``sonar.quantization.int4_packing``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sonar.quantization import ExpertsMethod, LinearExpertsMethod, LinearMethod, QuantizationMethod, UnquantizedLinearMethod, is_router
from sonar.quantization.int4_packing import PACK_FACTOR, Int4LinearMethod, pack_int4, unpack_int4
from sonar.quantization.sharding import bias_shard, input_shard, output_shard

NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble holding each of a word's 8 columns


class AWQLinearMethod(Int4LinearMethod):
    """One AWQ (GEMM) layer."""

    format_name = "awq"
    supports_tensor_parallel = True

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
        """Column-parallel: the rank's words of output columns (8 to a word) of ``qweight`` and
        ``qzeros`` and its columns of ``scales``. Row-parallel: its rows of ``qweight`` and its
        groups' rows of ``scales``/``qzeros`` (whole with one group per output channel)."""
        if param_name == "bias":
            return bias_shard(layer, tensor, part)
        if layer.parallel == "column":
            per_entry = 1 if param_name == "scales" else PACK_FACTOR
            return output_shard(layer, tensor, part, dim=1, rows_per_entry=per_entry, unit_name="packed int4 word")
        if param_name == "qweight":
            return input_shard(layer, tensor, dim=0)
        if self.group_size == -1:
            return tensor
        return input_shard(layer, tensor, dim=0, inputs_per_entry=self.group_size, unit_name="awq group")

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: slice | None) -> None:
        if param_name == "qweight":
            q = unpack_int4(tensor.to(torch.int32).cpu(), dim=1, order=NIBBLE_OF_COLUMN)  # [in, out]
            self.store(layer, "qweight", pack_int4(q.t(), dim=1), rows, out_dim=0)
        elif param_name == "qzeros":
            zeros = unpack_int4(tensor.to(torch.int32).cpu(), dim=1, order=NIBBLE_OF_COLUMN)
            self.store(layer, "qzeros", zeros.to(layer.qzeros.dtype), rows, out_dim=1)
        elif param_name == "scales":
            self.store(layer, "scales", tensor.to(layer.scales.dtype), rows, out_dim=1)
        else:
            super().load_checkpoint_tensor(layer, param_name, tensor, rows)


class AWQMethod(QuantizationMethod):
    """``quant_method: "awq"``: 4-bit, ``version: "gemm"``, with zero points, group size 128
    (or any multiple of 8) or -1; ``lm_head`` and ``modules_to_not_convert`` stay in floating
    point. Reads transformers' names (``bits``, ``group_size``) and AutoAWQ's (``w_bit``,
    ``q_group_size``)."""

    name = "awq"
    reads = "AWQ int4, GEMM packing (qweight/qzeros/scales; group 128, other multiples of 8 or -1; zero points)"
    execution = {
        "cpu": "dequantized per layer, torch matmul; a mixture-of-experts layer's experts each as such a layer, over its tokens",
        "cuda": "Triton: a GEMV for one row and a tensor-core product for 2-16, nibbles read as unit floats; a tiled GEMM "
        "dequantized in registers for more; a mixture-of-experts layer's experts dequantized at load into the fused kernel's stacked weights",
    }
    tested_by = {"cpu": "tests/test_quant_int4.py", "cuda": "tests/test_quant_cuda.py"}

    def __init__(self, group_size: int = 128, unconverted: tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.unconverted = unconverted

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> AWQMethod:
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported; Sonar runs 4-bit AWQ checkpoints")
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported; Sonar reads the 'gemm' packing (re-export the checkpoint with version='gemm')")
        if not quant_config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point=false) is not supported")
        group_size = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
        if group_size != -1 and (group_size <= 0 or group_size % 8):
            raise ValueError(f"AWQ group_size={group_size} is not supported; use -1 or a positive multiple of 8")
        return cls(group_size, tuple(quant_config.get("modules_to_not_convert") or ()))

    def experts_method(self, layer_prefix: str) -> ExpertsMethod | None:
        """Each expert's projections as AWQ layers (``LinearExpertsMethod``), unless the
        checkpoint left them unconverted."""
        if isinstance(self.linear_method(f"{layer_prefix}.0.gate_proj"), UnquantizedLinearMethod):
            return None
        return LinearExpertsMethod(self.linear_method, ("qweight", "qzeros", "scales"))

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        if layer_prefix in ("", "lm_head") or is_router(layer_prefix) or any(name in layer_prefix for name in self.unconverted):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self.group_size)
