"""SiLU-and-mul: the gated activation of Llama-style MLPs over a fused gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x_token,
    stride_out_token,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + token * stride_x_token + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x_token + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + token * stride_out_token + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[num_tokens, 2 * I]``, computed in float32."""
    num_tokens, double = x.shape
    intermediate = double // 2
    assert double == 2 * intermediate and x.stride(-1) == 1
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        x, out, x.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block, num_warps=4
    )
    return out


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Plain float32 torch version of :func:`silu_and_mul` (returns float32)."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
