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

Where Sonar's C kernels are built (``sonar_cpu.native``), float32 RMSNorm (with its residual
add), rotary, SiLU-and-mul and the sampler's row-wise argmax are each one C call instead of
several tensor operations.

The quantized-weight kernels of ``sonar_cpu.quant_ops`` are registered with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from sonar.ops import torch_rms_norm
from sonar_cpu import native, quant_ops

#: Up to this many tokens a step rotates with per-position matrices (one product per tensor);
#: beyond it the element-wise rotation is cheaper than building the matrices. Off: the
#: matrices' rounding differs from the element-wise rotation's by about 1e-7, and on the
#: natively quantized embedded GGUF that is enough to flip the chat template's first answer
#: token, a 0.08-nat tie between "The" and "L" that the int4 kernel's bfloat16 rounding
#: decides (the README's second identical chat request, whose few uncached tokens run through
#: the kernel, answered "L'Étoile..."). The rotation itself is right; the element-wise order
#: is the one Hugging Face uses, so every step rotates in place.
MAX_MATRIX_ROTARY_TOKENS = 0


def _native_for(*tensors: torch.Tensor):
    """Sonar's C kernels where every tensor is float32 (and the kernels are built), else None.
    Where they are, every float32 call takes them, whatever its layout (a copy makes it
    contiguous), so that a model never mixes the C and the tensor roundings of one operation."""
    if all(t.dtype == torch.float32 for t in tensors):
        return native.load()
    return None


def _norm_into(library, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (unless ``x`` is None), then the norm of ``residual`` into a new tensor;
    ``residual`` contiguous."""
    out = torch.empty_like(residual)
    dim = residual.shape[-1]
    library.add_rms_norm(
        None if x is None else x.contiguous().data_ptr(), residual.data_ptr(), weight.contiguous().data_ptr(),
        out.data_ptr(), residual.numel() // dim, dim, eps, torch.get_num_threads(),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; float32 activations and weights in one C call where the
    kernels are built (its sum of squares in another order than torch's mean: a few ulps), else
    the same operations as Hugging Face's (bit for bit) with the temporaries updated in place."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return torch_rms_norm(x, weight, eps)
    library = _native_for(x, weight)
    if library is not None:
        return _norm_into(library, None, x.contiguous(), weight, eps)
    inverse_rms = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * inverse_rms).mul_(weight)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then ``(rms_norm(residual), residual)``."""
    library = _native_for(x, residual, weight)
    if library is not None and residual.shape == x.shape and residual.is_contiguous():
        return _norm_into(library, x, residual, weight, eps), residual
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
    cos, sin = (half.contiguous() for half in cos_sin.to(dtype).chunk(2, dim=-1))  # [T, rotary_dim / 2] each
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
    matrix (new tensors), or in place (float32 in one C call where the kernels are built, the
    same roundings as the tensor operations)."""
    if tables.matrices is not None:
        return torch.matmul(query, tables.matrices), torch.matmul(key, tables.matrices)
    library = _rotary_kernel(query, key, tables)
    if library is None:
        return _rotate_in_place(query, tables.cos, tables.sin), _rotate_in_place(key, tables.cos, tables.sin)
    tokens, num_heads, head_dim = query.shape
    library.rotary_neox(
        query.data_ptr(), query.stride(0), num_heads, key.data_ptr(), key.stride(0), key.shape[1], head_dim,
        tables.cos.shape[-1], tables.cos.data_ptr(), tables.sin.data_ptr(), tokens,
    )
    return query, key


def _rotary_kernel(query: torch.Tensor, key: torch.Tensor, tables: RotaryTables):
    """The C rotation where it takes these tensors: float32 heads each contiguous, one after
    another within a token, and contiguous cos/sin rows."""
    for x in (query, key):
        if x.dtype != torch.float32 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return None
    if not (tables.cos.dtype == torch.float32 and tables.cos.is_contiguous() and tables.sin.is_contiguous()):
        return None
    return native.load()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2 * intermediate]`` input: float32 in one C call
    where the kernels are built (its exp is libm's, torch's is its own: a few ulps), else torch."""
    library = _native_for(gate_up)
    if library is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    gate_up = gate_up.contiguous()
    dim = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], dim)
    library.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * dim), dim, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN counts as the largest): float32 in
    one C call where the kernels are built (torch's CPU argmax reads a 49,152-token row about
    ten times slower than memory allows), else torch. The same answer either way."""
    library = _native_for(x)
    if library is None or x.dim() != 2 or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


OPS: dict[str, Callable[..., Any]] = {
    "argmax": argmax,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_tables": rotary_tables,
    "apply_rotary": apply_rotary,
    "silu_and_mul": silu_and_mul,
    **quant_ops.OPS,
}
