"""The ``gguf`` quantization method: llama.cpp's quantized tensors kept quantized in memory.

A GGUF file declares ``quantization_config = {"quant_method": "gguf"}`` (see ``gguf_file``), so
its linear layers are built with ``GGUFLinearMethod``, and the file's reader hands them their
tensors still in blocks (``GGUFBlocks``). At load each layer picks how to run them, the first
that applies:

- a platform's own kernel for the blocks as they are (``sonar.ops`` operation
  ``gguf_block_kernel(ggml_type)``, None where it has none): an object whose
  ``prepare(data)`` places a layer's blocks once (in any layout of its own), whose
  ``kernel(x, data, rows, cols, exact)`` multiplies by them (``exact``: the float product, for
  steps that carry prompt tokens; otherwise it may round the activations) and whose
  ``rows_in_order(data, start, stop)`` gives rows back in the file's layout; the CPU's are
  Sonar's C kernels for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL and Q2_K / Q3_K / Q4_K / Q5_K /
  Q6_K / IQ4_XS;
- else a platform kernel for 4-bit codes in groups of 32 (``sonar.ops`` operations
  ``int4_group_pack`` / ``int4_group_linear``; the CPU's runs torch's int4 weight-packed matmul)
  where the format maps onto it: Q4_0, Q4_1, Q4_K, and Q8_0 / Q5_0 / Q5_1 / Q5_K split into two nibbles; a
  4-bit layer keeps its blocks too and dequantizes them for products of many rows (prefill);
- otherwise the blocks stay as they are and each product dequantizes them a tile of rows at a
  time (Q2_K / Q3_K / Q6_K / IQ4_NL / IQ4_XS without a block kernel, and every format on a
  platform without a kernel): correct everywhere, if slow;
- F32 / F16 / BF16 tensors stay floating.

Fused layers (q/k/v, gate/up) stack their parts' blocks when the parts share a format and run
one product per run of parts otherwise. A tied ``lm_head`` (the embedding's table) receives the
quantized table as ``tied_weight``; the embedding itself keeps a dequantized copy for lookups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from sonar import ops
from sonar.moe import experts_by_group, fused_moe
from sonar.quantization import ExpertsMethod, LinearMethod, QuantizationMethod
from sonar.quantization.sharding import dense_shard, split_error
from sonar_models.formats.gguf_blocks import (
    BLOCK_SIZES, INT4_GROUP_TYPES, SPLIT_TYPES, GGUFBlocks, dequantize_blocks, int4_groups, stack_rows,
)

INT4_GROUP_PACK = "int4_group_pack"
INT4_GROUP_LINEAR = "int4_group_linear"
GGUF_BLOCK_KERNEL = "gguf_block_kernel"
for _name in (INT4_GROUP_PACK, INT4_GROUP_LINEAR, GGUF_BLOCK_KERNEL):
    ops.declare_op(_name)
#: Products of fewer rows than this run the platform's block kernel (where it has one) instead
#: of dequantizing a tile at a time into a float32 GEMM. Measured with the CPU's C kernels (eight
#: rows to a vector) on 2 AVX-512 cores, exact products of 2,816 x 1,024 and 1,024 x 2,816: the
#: kernel is as fast as dequantizing at 384 rows for the blocks of 32 and at 192-384 for the
#: K-quants, and 3-10x faster at 48 (Q5_0, Q5_1 and Q6_K decode slowest in torch).
BLOCK_KERNEL_MAX_ROWS = 256
TIED_HEAD_PARAM = "tied_weight"
DEQUANTIZE_TILE_ROWS = 4096  # rows dequantized at once by the blocks path
#: From this many rows of activations on (a prefill, a large decode batch), a packed layer
#: runs the float product of its blocks instead of the int4 kernel, and so does every product
#: of a step that carries prompt tokens (``sonar.ops.exact_products``, whatever its rows). The
#: int4 kernel rounds its inputs and outputs to bfloat16 (about 0.3% of a product's scale): a
#: prompt's last position decides the first token, and on the embedded SmolLM2 the chat
#: template's first answer token is a 0.08-nat tie that the kernel's rounding turns
#: ("L'Étoile..." for "The capital of France is Paris."), also when the prompt's last chunk is
#: short (chunked prefill, a prefix-cache hit). Decode steps below this many rows keep the
#: kernel, which is faster (measured on AVX-512 and AVX2 cores).
DENSE_MIN_ROWS = 16


@dataclass(slots=True)
class _Packed:
    """Rows run by the platform's int4 group kernel; where the original blocks are kept
    (``dense``), products of ``DENSE_MIN_ROWS`` rows or more, and those of steps that ask for
    exact products, run the blocks' float product instead."""

    linear: Callable[..., torch.Tensor]
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    input_repeats: int
    dense: _Blocks | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and (x.numel() >= DENSE_MIN_ROWS * x.shape[-1] or ops.exact_products_requested()):
            return self.dense(x)
        return self.linear(x, self.packed, self.scales_and_zeros, self.input_repeats)

    @property
    def nbytes(self) -> int:
        kept = 0 if self.dense is None else self.dense.nbytes
        return self.packed.nbytes + self.scales_and_zeros.nbytes + kept


@dataclass(slots=True)
class _Blocks:
    """Rows kept in GGUF blocks: products of fewer than ``BLOCK_KERNEL_MAX_ROWS`` rows run the
    platform's block kernel where there is one (its exact product in steps that ask for exact
    products, its fast one in decode steps), the others dequantize a tile at a time."""

    blocks: GGUFBlocks
    kernel: Callable[..., torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.numel() < BLOCK_KERNEL_MAX_ROWS * x.shape[-1]:
            exact = ops.exact_products_requested()
            return self.kernel(x, self.blocks.data, self.blocks.rows, self.blocks.cols, exact)
        tiles = []
        for start in range(0, self.blocks.rows, DEQUANTIZE_TILE_ROWS):
            tile = self._tile(start, min(start + DEQUANTIZE_TILE_ROWS, self.blocks.rows))
            tiles.append(torch.nn.functional.linear(x, dequantize_blocks(tile, x.dtype)))
        return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)

    def _tile(self, start: int, stop: int) -> GGUFBlocks:
        """Rows ``[start, stop)`` as blocks in the file's layout (the kernel may keep its own)."""
        if self.kernel is None:
            return self.blocks.select_rows(slice(start, stop))
        data = self.kernel.rows_in_order(self.blocks.data, start, stop)
        return GGUFBlocks(self.blocks.ggml_type, stop - start, self.blocks.cols, data)

    @property
    def nbytes(self) -> int:
        return self.blocks.data.nbytes


@dataclass(slots=True)
class _Dense:
    """Rows that were floating in the file."""

    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight.to(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


@dataclass(slots=True)
class _PendingParts:
    """Checkpoint tensors received so far, by first output row."""

    by_start: dict[int, GGUFBlocks | torch.Tensor] = field(default_factory=dict)

    def num_rows(self) -> int:
        return sum(part.shape[0] for part in self.by_start.values())


def _runs_of_one_format(parts: list[GGUFBlocks | torch.Tensor]) -> list[list[GGUFBlocks | torch.Tensor]]:
    runs: list[list[GGUFBlocks | torch.Tensor]] = []
    for part in parts:
        kind = part.ggml_type if isinstance(part, GGUFBlocks) else None
        if runs and (runs[-1][0].ggml_type if isinstance(runs[-1][0], GGUFBlocks) else None) == kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


class GGUFLinearMethod(LinearMethod):
    """A linear layer whose weight comes from a GGUF file, quantized or floating."""

    supports_tensor_parallel = True

    def __init__(self, tied_head: bool = False) -> None:
        self.tied_head = tied_head

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: Any, part: str | None) -> Any:
        """Blocks keep whole rows: a column-parallel rank takes its rows of blocks (zero bytes,
        which decode to zero, pad a vocabulary), a row-parallel one its run of blocks along
        each row (a rank's columns that would split a block are refused). Floating tensors
        shard as unquantized ones."""
        if not isinstance(tensor, GGUFBlocks):
            return dense_shard(layer, param_name, tensor, part)
        if layer.parallel == "column":
            index, count = layer.shards[part or ""]
            local = layer.local_parts[part or ""]
            data = tensor.data
            if data.shape[0] < local * count:
                data = torch.cat([data, data.new_zeros(local * count - data.shape[0], data.shape[1])])
            return GGUFBlocks(tensor.ggml_type, local, tensor.cols, data.narrow(0, index * local, local))
        values, nbytes = BLOCK_SIZES[tensor.ggml_type]
        local = layer.in_features
        if local % values:
            raise split_error(layer, "input columns", local, values, f"GGUF {tensor.type_name} block")
        width = local // values * nbytes
        data = tensor.data.narrow(1, layer.group.rank * width, width).contiguous()
        return GGUFBlocks(tensor.ggml_type, tensor.rows, local, data)

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        # placeholders the loader fills (their size is the format's, known only from the file)
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        if self.tied_head:
            setattr(layer, TIED_HEAD_PARAM, nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False))
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        layer.gguf_pending = _PendingParts()
        layer.gguf_runs = []

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: Any, rows: slice | None) -> None:
        if param_name == "bias":
            return super().load_checkpoint_tensor(layer, param_name, tensor, rows)
        if param_name not in ("weight", TIED_HEAD_PARAM):
            raise ValueError(f"is not a tensor a GGUF linear layer holds ({param_name!r})")
        start, stop = (0, layer.out_features) if rows is None else (rows.start, rows.stop)
        if tuple(tensor.shape) != (stop - start, layer.in_features):
            raise ValueError(f"has shape {tuple(tensor.shape)}, but the model expects {(stop - start, layer.in_features)}")
        layer.gguf_pending.by_start[start] = tensor
        if layer.gguf_pending.num_rows() == layer.out_features:
            self._finish(layer)

    def _finish(self, layer: nn.Module) -> None:
        device = layer.bias.device if layer.bias is not None else getattr(layer, TIED_HEAD_PARAM, layer.weight).device
        parts = [layer.gguf_pending.by_start[start] for start in sorted(layer.gguf_pending.by_start)]
        layer.gguf_runs = [self._prepare(run, device) for run in _runs_of_one_format(parts)]
        layer.gguf_pending = _PendingParts()

    def _prepare(self, run: list[GGUFBlocks | torch.Tensor], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        return prepare_run(run, device)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = run_rows(layer.gguf_runs, x)
        return out if layer.bias is None else out + layer.bias


def run_rows(runs: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The product of rows kept as runs of one format each, their outputs side by side."""
    return runs[0](x) if len(runs) == 1 else torch.cat([run(x) for run in runs], dim=-1)


def prepare_run(run: list[GGUFBlocks | torch.Tensor], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of one format placed on ``device`` and given the fastest path the platform has
    for them (see the module's docstring)."""
    if not isinstance(run[0], GGUFBlocks):
        return _Dense(torch.cat(run).to(device))
    blocks = stack_rows(run)
    probe = torch.empty(0, device=device)
    pack, linear = ops.platform_op(probe, INT4_GROUP_PACK), ops.platform_op(probe, INT4_GROUP_LINEAR)
    block_kernel = ops.platform_op(probe, GGUF_BLOCK_KERNEL)
    kernel = block_kernel(blocks.ggml_type) if block_kernel is not None else None
    if kernel is not None:  # the platform runs these blocks as they are, from where it placed them
        return _Blocks(GGUFBlocks(blocks.ggml_type, blocks.rows, blocks.cols, kernel.prepare(blocks.data.to(device))), kernel)
    kept = _Blocks(GGUFBlocks(blocks.ggml_type, blocks.rows, blocks.cols, blocks.data.to(device)))
    if blocks.ggml_type in INT4_GROUP_TYPES and pack is not None and linear is not None:
        codes, scales, zeros = int4_groups(blocks)
        packed, scales_and_zeros = pack(codes.to(device), scales.to(device), zeros.to(device))
        # the blocks stay too, for the exact products (prefills, steps that carry prompt tokens);
        # a Q8_0 table packed as two nibbles so costs about twice its size
        return _Packed(linear, packed, scales_and_zeros, 2 if blocks.ggml_type in SPLIT_TYPES else 1, kept)
    return kept


class GGUFExpertsMethod(ExpertsMethod):
    """The routed experts of a mixture-of-experts layer from a GGUF file.

    On the CPU each expert keeps its blocks and runs them as a GGUF linear layer would (its
    gate and up rows as one product, then down) over the tokens routed to it, so a model's
    experts take their size in the file. Elsewhere (a GPU, whose decode graphs cannot read the
    routing on the host) they are dequantized once, when the last part arrives, into the stacked
    floating tensors ``sonar.moe.fused_moe`` runs."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        self.hold_whole_experts(layer, "a GGUF model's experts")
        layer.gguf_dtype = torch.get_default_dtype()
        layer.gguf_sizes = (hidden_size, intermediate_size)
        layer.gguf_parts = {}
        layer.gguf_experts = [None] * num_experts
        layer.gguf_batched = None

    def load_checkpoint_part(self, layer: nn.Module, leaf: str, tensor: Any, part: tuple[int, str, str]) -> None:
        hidden, intermediate = layer.gguf_sizes
        expert, name, _ = part
        expected = (hidden, intermediate) if name == "down" else (intermediate, hidden)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, but expert {expert}'s {name} projection is {expected}")
        layer.gguf_parts[(expert, name)] = tensor
        if not all((expert, n) in layer.gguf_parts for n in ("gate", "up", "down")):
            return
        gate, up, down = (layer.gguf_parts.pop((expert, n)) for n in ("gate", "up", "down"))
        device = layer.w13.device
        if device.type == "cpu":
            layer.gguf_experts[expert] = (
                [prepare_run(run, device) for run in _runs_of_one_format([gate, up])],
                [prepare_run(run, device) for run in _runs_of_one_format([down])],
            )
            if all(e is not None for e in layer.gguf_experts):
                layer.gguf_batched = _batched_experts(layer.gguf_experts)
            return
        layer.gguf_experts[expert] = (gate, up, down)
        if all(e is not None for e in layer.gguf_experts):
            self._dequantize(layer)

    def _dequantize(self, layer: nn.Module) -> None:
        """Every expert as the stacked floating tensors of ``fused_moe`` (the blocks are dropped)."""
        def floating(part: GGUFBlocks | torch.Tensor) -> torch.Tensor:
            return dequantize_blocks(part, layer.gguf_dtype) if isinstance(part, GGUFBlocks) else part.to(layer.gguf_dtype)

        device = layer.w13.device
        w13 = torch.stack([torch.cat([floating(gate), floating(up)]) for gate, up, _ in layer.gguf_experts])
        w2 = torch.stack([floating(down) for _, _, down in layer.gguf_experts])
        layer.w13 = nn.Parameter(w13.to(device), requires_grad=False)
        layer.w2 = nn.Parameter(w2.to(device), requires_grad=False)
        layer.gguf_experts = None

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.gguf_experts is None:
            return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.expert_map)

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up, down = layer.gguf_experts[expert]
            gate, up = run_rows(gate_up, rows).chunk(2, dim=-1)
            return run_rows(down, torch.nn.functional.silu(gate) * up)

        batched = layer.gguf_batched if not ops.exact_products_requested() else None  # prompt steps: the exact products
        grouped = batched.run if batched is not None else None
        return experts_by_group(x, topk_weights, topk_ids, layer.expert_map, len(layer.gguf_experts), expert_mlp, grouped)


@dataclass(slots=True)
class _BatchedExperts:
    """Every expert's gate/up and down blocks where the platform's block kernel multiplies
    several matrices in one call (``experts``): a decode step's chosen experts in two calls a
    layer instead of two per expert."""

    gate_up: Any  # the block kernel of the gate/up blocks
    gate_up_pointers: torch.Tensor  # [E] int64: each expert's prepared gate/up blocks
    down: Any
    down_pointers: torch.Tensor
    hidden: int
    intermediate: int

    def run(self, grouped_x: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        active = [e for e, count in enumerate(counts) if count]
        starts = torch.tensor([0, *itertools.accumulate(counts[e] for e in active)], dtype=torch.int64)
        index = torch.tensor(active, dtype=torch.int64)
        h = self.gate_up.experts(grouped_x, self.gate_up_pointers[index], starts, 2 * self.intermediate, self.hidden)
        if h is None:
            return None
        gate, up = h.chunk(2, dim=-1)
        out = self.down.experts(torch.nn.functional.silu(gate) * up, self.down_pointers[index], starts, self.hidden, self.intermediate)
        return None if out is None else out.to(grouped_x.dtype)


def _batched_experts(experts: list[tuple[list, list]]) -> _BatchedExperts | None:
    """The experts as one batch for the block kernel, where each expert's gate/up and down are
    one run of blocks each, of one type across the experts, on a kernel that takes batches."""
    runs = [(gate_up[0], down[0]) for gate_up, down in experts if len(gate_up) == 1 and len(down) == 1]
    if len(runs) != len(experts) or not all(isinstance(r, _Blocks) and r.kernel is not None for pair in runs for r in pair):
        return None
    for side in (0, 1):
        kinds = {pair[side].blocks.ggml_type for pair in runs}
        if len(kinds) != 1 or not hasattr(runs[0][side].kernel, "experts"):
            return None
    gate_up, down = runs[0]
    return _BatchedExperts(
        gate_up.kernel, torch.tensor([pair[0].blocks.data.data_ptr() for pair in runs], dtype=torch.int64),
        down.kernel, torch.tensor([pair[1].blocks.data.data_ptr() for pair in runs], dtype=torch.int64),
        hidden=gate_up.blocks.cols, intermediate=down.blocks.cols,
    )


class GGUFMethod(QuantizationMethod):
    """llama.cpp's block formats run natively (registered as ``"gguf"``; every platform)."""

    name = "gguf"
    reads = ("a .gguf file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS blocks (F32/F16/BF16 tensors stay floating); other types "
             "are dequantized at load")
    execution = {
        "cpu": "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS: Sonar's C kernels on the blocks (in huge pages, eight rows to a vector): "
        "decode batches under 256 rows with the activations rounded to int8 blocks of 32 (integer dot products, as "
        "llama.cpp), steps with prompt tokens under 256 rows exact in float32, larger ones dequantized per tile into a "
        "float32 GEMM; where the C kernels cannot be built (or with SONAR_CPU_GGUF_KERNEL=0): torch's int4 weight-packed "
        "matmul (bf16) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K decode steps under 16 rows, the float32 product otherwise, Q2_K/Q3_K/Q6_K/IQ4_NL/IQ4_XS "
        "dequantized per tile; a mixture-of-experts layer's experts: each expert's blocks as above, over the tokens routed to it",
        "cuda": "dequantized per tile of 4,096 rows, library GEMM; a mixture-of-experts layer's experts dequantized at load "
        "into the fused kernel's stacked weights",
    }
    tested_by = {"cpu": "sonar-models/tests/test_gguf_native.py"}

    def __init__(self, tied_lm_head: bool = False) -> None:
        self.tied_lm_head = tied_lm_head

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GGUFMethod:
        """``quant_config["tied_lm_head"]``: the file has no ``output.weight`` (the head reads the embedding's table)."""
        return cls(tied_lm_head=bool(quant_config.get("tied_lm_head", False)))

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        return GGUFLinearMethod(tied_head=self.tied_lm_head and layer_prefix == "lm_head")

    def experts_method(self, layer_prefix: str) -> ExpertsMethod:
        return GGUFExpertsMethod()
