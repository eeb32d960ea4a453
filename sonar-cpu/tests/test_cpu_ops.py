"""The CPU platform's C layer operations against the tensor operations they replace."""

from __future__ import annotations

import pytest
import torch

from sonar.ops import torch_rms_norm
from sonar_cpu import native, ops

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler or no AVX2/FMA/F16C here")


@pytest.mark.parametrize("dim", [576, 64, 37])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_and_the_fused_residual_add(rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    x, residual = torch.randn(rows, dim, generator=generator) * 3, torch.randn(rows, dim, generator=generator)
    weight = torch.randn(dim, generator=generator)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)
    expected_residual = x + residual
    out, summed = ops.fused_add_rms_norm(x.clone(), residual, weight, 1e-5)
    assert summed.data_ptr() == residual.data_ptr() and torch.equal(summed, expected_residual)  # in place, exact
    torch.testing.assert_close(out, torch_rms_norm(expected_residual, weight, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "rotary_dim"), [(9, 3, 64, 64), (4, 2, 32, 16), (2, 2, 80, 80)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_rounds_as_the_tensor_operations_do(num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, tokens: int) -> None:
    generator = torch.Generator().manual_seed(head_dim + tokens)
    # query and key as views of one fused projection, as the model hands them over
    fused = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    angles = torch.rand(tokens, rotary_dim // 2, generator=generator) * 6
    tables = ops.RotaryTables(None, angles.cos()[:, None, :], angles.sin()[:, None, :])
    expected = fused.clone()
    q_ref = expected[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k_ref = expected[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    ops._rotate_in_place(q_ref, tables.cos, tables.sin)
    ops._rotate_in_place(k_ref, tables.cos, tables.sin)
    query = fused[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    key = fused[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    assert ops._rotary_kernel(query, key, tables) is not None
    ops.apply_rotary(query, key, tables)
    assert torch.equal(fused, expected)  # bit for bit, the values past the rotary dims and v untouched


def test_other_dtypes_and_layouts_keep_the_tensor_operations() -> None:
    tables = ops.RotaryTables(None, torch.ones(2, 1, 4), torch.zeros(2, 1, 4))
    assert ops._rotary_kernel(torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 8), tables) is None
    assert ops._rotary_kernel(torch.zeros(2, 8, 3).transpose(1, 2), torch.zeros(2, 1, 8), tables) is None
    assert ops._native_for(torch.zeros(4, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("rows", [1, 7])
def test_silu_and_mul(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=2e-6)
    assert ops.silu_and_mul(gate_up.to(torch.bfloat16)).dtype == torch.bfloat16  # other dtypes: torch


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (5, 37), (64, 1000), (3, 7)])
def test_argmax_answers_as_torch_does(rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    # ties: the first index; NaN: the first NaN; all -inf: 0; -0.0 and 0.0 compare equal
    hostile = torch.full((6, vocab), -float("inf"))
    hostile[1, vocab // 2:] = 3.0
    hostile[2, [vocab - 1, vocab // 3]] = float("nan")
    hostile[2, 0] = float("inf")
    hostile[3, :] = 0.0
    hostile[3, vocab // 2] = -0.0
    hostile[4, vocab - 1] = float("inf")
    hostile[5] = torch.randint(0, 3, (vocab,), generator=generator).float()
    assert torch.equal(ops.argmax(hostile), hostile.argmax(dim=-1))
    # a strided view is read as its values
    wide = torch.randn(rows, 2 * vocab, generator=generator)[:, ::2]
    assert torch.equal(ops.argmax(wide), wide.argmax(dim=-1))
    assert ops.argmax(logits.to(torch.bfloat16)).dtype == torch.int64  # other dtypes: torch
