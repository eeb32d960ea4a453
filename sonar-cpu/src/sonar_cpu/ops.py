"""This platform's kernels behind ``sonar.ops`` (named by ``CpuPlatform.ops_module``).

On the CPU a decode step of a small model is a few thousand tiny tensor operations, each
costing a few microseconds of dispatch whatever its size, so these versions do the same maths
as the torch ones in ``sonar.ops`` in fewer operations:

- RMSNorm of float32 activations updates its temporaries in place (torch's own ``rms_norm`` is
  slower on the CPU than the operations it stands for); other dtypes keep Hugging Face's order
  (normalise in float32, round, then scale);
- the fused add + norm adds into the residual in place;
- rotary rotates in place (a batched product with per-position rotation matrices is kept
  behind ``MAX_MATRIX_ROTARY_TOKENS``, off: see there).

The quantized-weight kernels of ``sonar_cpu.quant_ops`` are registered with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from sonar.ops import torch_rms_norm
from sonar_cpu import quant_ops

#: Up to this many tokens a step rotates with per-position matrices (one product per tensor);
#: beyond it the element-wise rotation is cheaper than building the matrices. Off: the
#: matrices' rounding differs from the element-wise rotation's by about 1e-7, and on the
#: natively quantized embedded GGUF that is enough to flip the chat template's first answer
#: token, a 0.08-nat tie between "The" and "L" that the int4 kernel's bfloat16 rounding
#: decides (the README's second identical chat request, whose few uncached tokens run through
#: the kernel, answered "L'Étoile..."). The rotation itself is right; the element-wise order
#: is the one Hugging Face uses, so every step rotates in place.
MAX_MATRIX_ROTARY_TOKENS = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; for float32 activations and weights the same operations
    as Hugging Face's (bit for bit), with the temporaries updated in place."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return torch_rms_norm(x, weight, eps)
    inverse_rms = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * inverse_rms).mul_(weight)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then ``(rms_norm(residual), residual)``."""
    if residual.dtype != x.dtype or residual.shape != x.shape:
        residual = x + residual
    else:
        residual = residual.add_(x)
    return rms_norm(residual, weight, eps), residual


@dataclass(slots=True)
class RotaryTables:
    """One step's rotary state: per-position rotation matrices ``[T, D, D]`` for a few tokens,
    else cos/sin halves ``[T, 1, rotary_dim / 2]`` for the element-wise rotation."""

    matrices: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def rotary_tables(rotary_emb: Any, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
    """Rows of the model's float32 cos/sin table for this step's positions, cast to ``dtype``;
    as rotation matrices when the step has at most ``MAX_MATRIX_ROTARY_TOKENS`` tokens."""
    cos_sin = rotary_emb.cos_sin_cache(positions.device)[positions]  # [T, rotary_dim]
    cos, sin = cos_sin.to(dtype).chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    head_dim = rotary_emb.spec.head_dim
    if positions.numel() > MAX_MATRIX_ROTARY_TOKENS:
        return RotaryTables(None, cos[:, None, :], sin[:, None, :])
    return RotaryTables(rotation_matrices(cos, sin, head_dim), None, None)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[T, head_dim, head_dim]`` such that ``x @ m`` is the neox rotation of ``x``'s first
    ``2 * half`` dims (``cos``/``sin``: ``[T, half]``); the dims beyond pass through."""
    num_tokens, half = cos.shape
    matrices = torch.zeros(num_tokens, head_dim, head_dim, dtype=cos.dtype, device=cos.device)
    first, second = torch.arange(half, device=cos.device), torch.arange(half, 2 * half, device=cos.device)
    # out[j] = x[j] cos - x[j + half] sin;  out[j + half] = x[j + half] cos + x[j] sin
    matrices[:, first, first] = cos
    matrices[:, second, second] = cos
    matrices[:, second, first] = -sin
    matrices[:, first, second] = sin
    passed = torch.arange(2 * half, head_dim, device=cos.device)
    matrices[:, passed, passed] = 1
    return matrices


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    x1_sin, x2_sin = x1 * sin, x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def apply_rotary(query: torch.Tensor, key: torch.Tensor, tables: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, H, D]`` and ``key`` ``[T, KVH, D]``: a product with each token's
    matrix (new tensors), or in place."""
    if tables.matrices is not None:
        return torch.matmul(query, tables.matrices), torch.matmul(key, tables.matrices)
    return _rotate_in_place(query, tables.cos, tables.sin), _rotate_in_place(key, tables.cos, tables.sin)


OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_tables": rotary_tables,
    "apply_rotary": apply_rotary,
    **quant_ops.OPS,
}
