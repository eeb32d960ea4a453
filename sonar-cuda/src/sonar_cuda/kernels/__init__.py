"""Triton kernels, one per file, each beside a plain float32 torch reference of the same name
prefixed ``reference_``.

Importing this package imports Triton. Set ``TRITON_INTERPRET=1`` before that import to run the
kernels on CPU tensors (slowly), as the CPU test suite does.
"""

from sonar_cuda.kernels.activation import reference_silu_and_mul, silu_and_mul
from sonar_cuda.kernels.decode_attention import decode_attention, reference_decode_attention
from sonar_cuda.kernels.kv_cache import reference_reshape_and_cache, reshape_and_cache
from sonar_cuda.kernels.layernorm import fused_add_rms_norm, reference_rms_norm, rms_norm
from sonar_cuda.kernels.prefill_attention import prefill_attention, reference_prefill_attention
from sonar_cuda.kernels.rotary import reference_rotary_embedding, rotary_embedding

__all__ = [
    "decode_attention",
    "fused_add_rms_norm",
    "prefill_attention",
    "reference_decode_attention",
    "reference_prefill_attention",
    "reference_reshape_and_cache",
    "reference_rms_norm",
    "reference_rotary_embedding",
    "reference_silu_and_mul",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
