"""GPTQ int4 checkpoints (AutoGPTQ / GPTQModel, as transformers loads them).

On disk, per quantized projection of ``in`` inputs and ``out`` outputs:

- ``qweight`` int32 ``[in / 8, out]``: 4-bit values packed along the input dim (value ``8i + j``
  of column ``n`` in bits ``4j``);
- ``qzeros`` int32 ``[groups, out / 8]``: zero points packed along the output dim; the classic
  format (``checkpoint_format: "gptq"``) stores each zero point minus one, ``gptq_v2`` stores
  it as is;
- ``scales`` float16 ``[groups, out]``;
- ``g_idx`` int32 ``[in]``: the group of each input (``k // group_size``, or the activation
  order's groups with ``desc_act``).

``W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``. Loading repacks into the
runtime layout of ``sonar.quantization.int4_packing`` (inputs permuted so that groups are
contiguous where ``g_idx`` says they are not).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sonar.quantization import ExpertsMethod, LinearExpertsMethod, LinearMethod, QuantizationMethod, UnquantizedLinearMethod, is_router
from sonar.quantization.int4_packing import PACK_FACTOR, Int4LinearMethod, pack_int4, unpack_int4
from sonar.quantization.sharding import bias_shard, input_shard, output_shard

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point
ROW_SHARD_TENSORS = ("qweight", "g_idx", "qzeros", "scales")  # what a row-parallel rank's layer is built from


class GPTQLinearMethod(Int4LinearMethod):
    """One GPTQ layer. A part's ``qweight`` waits for the layer's ``g_idx`` (the input order it
    is repacked in); fused parts must share it, as parts quantized on the same inputs do."""

    format_name = "gptq"
    supports_tensor_parallel = True

    def __init__(self, group_size: int, zero_offset: int) -> None:
        super().__init__(group_size)
        self.zero_offset = zero_offset

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().create_weights(layer, in_features, output_sizes, bias, dtype)
        layer.g_idx = nn.Parameter(torch.zeros(in_features, dtype=torch.int32), requires_grad=False)
        layer.checkpoint_g_idx = None  # the first part's g_idx, once loaded
        layer.pending_qweights = []  # (tensor, rows) of parts that arrived before it
        layer.row_shard_tensors = {}  # a row-parallel rank's tensors, until all of ROW_SHARD_TENSORS came

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
        """Column-parallel: the rank's output columns of ``qweight``, ``scales`` and the packed
        ``qzeros`` (``g_idx`` whole). Row-parallel: the rank's rows of ``qweight`` and its
        inputs' ``g_idx``; ``scales`` and ``qzeros`` come whole, since in activation order the
        rank's inputs may draw on any group (``_finish_row_shard`` keeps what they use)."""
        if param_name == "bias":
            return bias_shard(layer, tensor, part)
        if layer.parallel == "column":
            if param_name == "g_idx":
                return tensor
            per_entry = PACK_FACTOR if param_name == "qzeros" else 1
            return output_shard(layer, tensor, part, dim=1, rows_per_entry=per_entry, unit_name="packed int4 word")
        if param_name == "qweight":
            return input_shard(layer, tensor, dim=0, inputs_per_entry=PACK_FACTOR, unit_name="packed int4 word")
        if param_name == "g_idx":
            return input_shard(layer, tensor, dim=0)
        return tensor

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: slice | None) -> None:
        if getattr(layer, "parallel", "replicated") == "row" and param_name in ROW_SHARD_TENSORS:
            layer.row_shard_tensors[param_name] = tensor
            if len(layer.row_shard_tensors) == len(ROW_SHARD_TENSORS):
                self._finish_row_shard(layer)
            return
        if param_name == "qweight":
            if layer.checkpoint_g_idx is None:
                layer.pending_qweights.append((tensor, rows))
            else:
                self._store_qweight(layer, tensor, rows)
        elif param_name == "g_idx":
            self._load_g_idx(layer, tensor)
        elif param_name == "qzeros":
            zeros = unpack_int4(tensor.to(torch.int32), dim=1) + self.zero_offset
            self.store(layer, "qzeros", zeros.to(layer.qzeros.dtype), rows, out_dim=1)
        elif param_name == "scales":
            self.store(layer, "scales", tensor.to(layer.scales.dtype), rows, out_dim=1)
        else:
            super().load_checkpoint_tensor(layer, param_name, tensor, rows)

    def _load_g_idx(self, layer: nn.Module, g_idx: torch.Tensor) -> None:
        g_idx = g_idx.to(torch.int64).cpu()
        if layer.checkpoint_g_idx is not None:
            if not torch.equal(g_idx, layer.checkpoint_g_idx):
                raise ValueError("differs from the g_idx of another part of the same fused projection (Sonar runs fused parts in one input order)")
            return
        in_features = layer.input_order.numel()
        if tuple(g_idx.shape) != (in_features,):
            raise ValueError(f"has shape {tuple(g_idx.shape)}, but the layer has {in_features} inputs")
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[order], torch.arange(in_features) // layer.group_size):
            raise ValueError(f"does not put {layer.group_size} inputs in each group (is group_size right?)")
        layer.checkpoint_g_idx = g_idx
        with torch.no_grad():
            layer.g_idx.copy_(g_idx.to(torch.int32))
            layer.input_order.copy_(order)
        layer.act_order = not torch.equal(order, torch.arange(in_features))
        for tensor, rows in layer.pending_qweights:
            self._store_qweight(layer, tensor, rows)
        layer.pending_qweights = []

    def _finish_row_shard(self, layer: nn.Module) -> None:
        """A row-parallel rank's layer from its inputs' ``qweight`` and ``g_idx`` and the whole
        ``scales``/``qzeros``: where its inputs form whole consecutive groups (always without
        activation order), those groups' rows in the usual layout; else (activation order)
        every group's rows, each input keeping its own group (``group_index``)."""
        tensors, layer.row_shard_tensors = layer.row_shard_tensors, {}
        g_idx = tensors["g_idx"].to(torch.int64).cpu()
        in_features = layer.input_order.numel()
        if tuple(g_idx.shape) != (in_features,):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, but the rank's layer has {in_features} inputs")
        zeros = unpack_int4(tensors["qzeros"].to(torch.int32), dim=1) + self.zero_offset  # [groups, out]
        scales = tensors["scales"]
        first = int(g_idx.min())
        num_local_groups = in_features // layer.group_size
        if torch.equal(torch.sort(g_idx).values, first + torch.arange(in_features) // layer.group_size):
            self._load_g_idx(layer, g_idx - first)
            local = slice(first, first + num_local_groups)
            self.store(layer, "qzeros", zeros[local].to(layer.qzeros.dtype), None, out_dim=1)
            self.store(layer, "scales", scales[local].to(layer.scales.dtype), None, out_dim=1)
            self._store_qweight(layer, tensors["qweight"], None)
            return
        device, dtype = layer.scales.device, layer.scales.dtype
        layer.scales = nn.Parameter(scales.to(device, dtype), requires_grad=False)
        layer.qzeros = nn.Parameter(zeros.to(device, dtype), requires_grad=False)
        with torch.no_grad():
            layer.g_idx.copy_(g_idx.to(torch.int32))
        layer.checkpoint_g_idx = g_idx
        layer.group_index = g_idx.to(device)
        q = unpack_int4(tensors["qweight"].to(torch.int32).cpu(), dim=0)  # [in, out], the rank's inputs in order
        self.store(layer, "qweight", pack_int4(q.t(), dim=1), None, out_dim=0)

    def _store_qweight(self, layer: nn.Module, qweight: torch.Tensor, rows: slice | None) -> None:
        q = unpack_int4(qweight.to(torch.int32).cpu(), dim=0)  # [in, out]
        if layer.act_order:
            q = q.index_select(0, layer.input_order.cpu())
        self.store(layer, "qweight", pack_int4(q.t(), dim=1), rows, out_dim=0)


class GPTQMethod(QuantizationMethod):
    """``quant_method: "gptq"``: 4-bit, group size 128 (or any multiple of 8) or -1 (one group
    per output channel), symmetric or not, with or without ``desc_act``; ``lm_head`` and
    ``modules_to_not_convert`` stay in floating point."""

    name = "gptq"
    reads = "GPTQ int4 (qweight/qzeros/scales/g_idx; group 128, other multiples of 8 or -1; sym or not; desc_act; checkpoint_format gptq or gptq_v2)"
    execution = {
        "cpu": "dequantized per layer, torch matmul; a mixture-of-experts layer's experts each as such a layer, over its tokens",
        "cuda": "Triton: a GEMV for one row and a tensor-core product for 2-16, nibbles read as unit floats; a tiled GEMM "
        "dequantized in registers for more; a mixture-of-experts layer's experts dequantized at load into the fused kernel's stacked weights",
    }
    tested_by = {"cpu": "tests/test_quant_int4.py", "cuda": "tests/test_quant_cuda.py"}

    def __init__(self, group_size: int = 128, zero_offset: int = 1, unconverted: tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.unconverted = unconverted

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GPTQMethod:
        bits = int(quant_config.get("bits", 4))
        if bits != 4:
            raise ValueError(f"GPTQ with bits={bits} is not supported; Sonar runs 4-bit GPTQ checkpoints")
        checkpoint_format = quant_config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; Sonar reads {', '.join(CHECKPOINT_FORMATS)}"
            )
        if quant_config.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        group_size = int(quant_config.get("group_size", 128))
        if group_size != -1 and (group_size <= 0 or group_size % 8):
            raise ValueError(f"GPTQ group_size={group_size} is not supported; use -1 or a positive multiple of 8")
        return cls(group_size, CHECKPOINT_FORMATS[checkpoint_format], tuple(quant_config.get("modules_to_not_convert") or ()))

    def experts_method(self, layer_prefix: str) -> ExpertsMethod | None:
        """Each expert's projections as GPTQ layers (``LinearExpertsMethod``), unless the
        checkpoint left them unconverted."""
        if isinstance(self.linear_method(f"{layer_prefix}.0.gate_proj"), UnquantizedLinearMethod):
            return None
        return LinearExpertsMethod(self.linear_method, ("qweight", "qzeros", "scales", "g_idx"))

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        if layer_prefix in ("", "lm_head") or is_router(layer_prefix) or any(name in layer_prefix for name in self.unconverted):
            return UnquantizedLinearMethod()
        return GPTQLinearMethod(self.group_size, self.zero_offset)
