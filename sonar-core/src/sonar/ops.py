"""The few element-wise operations models share, with a seam for platform kernels.

Models call ``sonar.ops.rms_norm(x, ...)`` and friends instead of writing the torch themselves.
Each call runs the platform's kernel for the tensor's device type when one is registered, else
the plain torch version below (the numerics of Hugging Face's Llama/Qwen code).

A platform names a module in ``Platform.ops_module``; that module holds ``OPS``, a dict from
operation name (``"linear"``, ``"rms_norm"``, ``"fused_add_rms_norm"``, ``"silu_and_mul"``,
``"rotary_tables"``, ``"apply_rotary"``, ``"argmax"``) to a function with the signature below. The worker
calls :func:`install_platform_ops` once, so models never import a platform package.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable

import torch

#: device type -> operation name -> platform implementation
_OVERRIDES: dict[str, dict[str, Callable[..., Any]]] = {}
OP_NAMES = ("linear", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_tables", "apply_rotary", "argmax")
#: operations declared outside this module (a quantization method's GEMM, say)
_DECLARED: set[str] = set()


_EXACT_PRODUCTS: ContextVar[bool] = ContextVar("sonar_exact_products", default=False)


@contextmanager
def exact_products(on: bool = True) -> Iterator[None]:
    """While inside (with ``on``), quantized layers that have a fast approximate product (a
    kernel rounding its inputs and outputs to bfloat16, say) run their exact one instead.

    The model runner enters it for every step that carries prompt tokens: a prompt's last
    position decides the request's first token, and a near tie there must come out as the
    float product would give it, however the prompt was cut into chunks or how much of it came
    from the prefix cache. Decode-only steps keep the fast path."""
    token = _EXACT_PRODUCTS.set(on)
    try:
        yield
    finally:
        _EXACT_PRODUCTS.reset(token)


def exact_products_requested() -> bool:
    """Whether the current forward asked for exact quantized products (see :func:`exact_products`)."""
    return _EXACT_PRODUCTS.get()


def declare_op(name: str) -> None:
    """Let platforms register a kernel for the operation ``name``, which a module outside this
    one defines and dispatches through :func:`platform_op` (a quantized GEMM, say)."""
    _DECLARED.add(name)


def platform_op(x: torch.Tensor, name: str) -> Callable[..., Any] | None:
    """The platform kernel registered for ``name`` on ``x``'s device type (None: run the torch version)."""
    return _override(x, name)


def register_ops(device_type: str, ops: dict[str, Callable[..., Any]]) -> None:
    """Use ``ops`` (names from :data:`OP_NAMES` or declared with :func:`declare_op`) for
    tensors on ``device_type``."""
    unknown = set(ops) - set(OP_NAMES) - _DECLARED
    if unknown:
        raise ValueError(f"unknown operations {sorted(unknown)}; known: {sorted(set(OP_NAMES) | _DECLARED)}")
    _OVERRIDES.setdefault(device_type, {}).update(ops)


def unregister_ops(device_type: str) -> None:
    """Back to the torch versions for ``device_type``."""
    _OVERRIDES.pop(device_type, None)


def install_platform_ops(platform: Any) -> None:
    """Register the ``OPS`` of ``platform.ops_module`` (if it names one) for its device type."""
    module_name = getattr(platform, "ops_module", "")
    if module_name:
        register_ops(platform.device_type, importlib.import_module(module_name).OPS)


def _override(x: torch.Tensor, name: str) -> Callable[..., Any] | None:
    table = _OVERRIDES.get(x.device.type)
    return table.get(name) if table else None


# -- projections ------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` over the last dimension of ``x``, in ``x``'s dtype.

    Platforms may route shapes their own kernels serve better (a single row, say, where the
    product reads the whole weight for one output row) and leave the rest to torch."""
    impl = _override(x, "linear")
    return torch.nn.functional.linear(x, weight, bias) if impl is None else impl(x, weight, bias)


# -- norms -------------------------------------------------------------------------------


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, round to ``x``'s dtype, then scale by ``weight`` (Hugging Face's order)."""
    input_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(input_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape); returns a new tensor."""
    impl = _override(x, "rms_norm")
    return torch_rms_norm(x, weight, eps) if impl is None else impl(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (rounded to the dtype), then ``(rms_norm(residual), residual)``.

    Platform versions may work in place on both inputs: callers must not reuse ``x`` or
    ``residual`` afterwards, only the returned tensors.
    """
    impl = _override(x, "fused_add_rms_norm")
    if impl is not None:
        return impl(x, residual, weight, eps)
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


# -- activation --------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2 * intermediate]`` input."""
    impl = _override(gate_up, "silu_and_mul")
    if impl is not None:
        return impl(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# -- rotary ------------------------------------------------------------------------------


def rotary_tables(rotary_emb: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any:
    """Once per step: whatever :func:`apply_rotary` needs for ``positions``.

    The torch version returns ``(cos, sin)`` ``[T, rotary_dim]`` in ``dtype`` from
    ``rotary_emb(positions, dtype)``; a platform may instead return ``(positions, table)``
    with a precomputed per-position table (``rotary_emb.cos_sin_cache(device)``).
    """
    impl = _override(positions, "rotary_tables")
    return rotary_emb(positions, dtype) if impl is None else impl(rotary_emb, positions, dtype)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, H, D]`` and ``key`` ``[T, KVH, D]`` (neox layout) with this step's
    ``tables`` from :func:`rotary_tables`. Platform versions may rotate in place."""
    impl = _override(query, "apply_rotary")
    if impl is not None:
        return impl(query, key, tables)
    cos, sin = tables
    return _torch_apply_rotary(query, cos, sin), _torch_apply_rotary(key, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, rotary_dim]
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# -- selection ---------------------------------------------------------------------------


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value of each row of ``x`` ``[B, V]``: ``[B]`` int64, the first
    one on ties (a NaN counts as the largest, as in torch)."""
    impl = _override(x, "argmax")
    return x.argmax(dim=-1) if impl is None else impl(x)
