"""The CPU platform's kernels for quantized weights, registered through ``sonar.ops``.

``int4_group_pack(codes, scales, zeros)`` packs a matrix of 4-bit codes in groups of 32
(``w = scale * (code - 8) + zero``) and ``int4_group_linear(x, packed, scales_and_zeros,
input_repeats)`` multiplies by it; a quantization method asks for both with
``sonar.ops.platform_op`` and runs its own torch version where a platform has none.
``gguf_block_kernel(ggml_type)`` answers Sonar's C kernel for one layer's GGUF blocks of that
type (``sonar_cpu.gguf_kernel.GGUFBlockKernel``: ``prepare(data)`` places the blocks,
``kernel(x, data, rows, cols, exact)`` multiplies, ``rows_in_order(data, start, stop)`` gives
rows back in the file's layout) or None.
"""

from __future__ import annotations

from sonar import ops

from sonar_cpu.gguf_kernel import block_kernel
from sonar_cpu.quant_int4 import int4_group_linear, pack_int4_groups

INT4_GROUP_PACK = "int4_group_pack"
INT4_GROUP_LINEAR = "int4_group_linear"
GGUF_BLOCK_KERNEL = "gguf_block_kernel"
for name in (INT4_GROUP_PACK, INT4_GROUP_LINEAR, GGUF_BLOCK_KERNEL):
    ops.declare_op(name)

OPS = {INT4_GROUP_PACK: pack_int4_groups, INT4_GROUP_LINEAR: int4_group_linear, GGUF_BLOCK_KERNEL: block_kernel}
