"""Neox-style rotary embedding against its reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, assert_close

from sonar_cuda.kernels.rotary import build_cos_sin_cache, reference_rotary_embedding, rotary_embedding

# (num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim)
SMALL_CASES = [(3, 4, 4, 64, 64), (5, 8, 2, 128, 128), (2, 8, 1, 64, 32)]
LARGE_CASES = [(1, 16, 8, 128, 128), (4099, 32, 8, 128, 128), (777, 12, 4, 64, 64), (100, 32, 32, 80, 40)]


def check(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(num_tokens + num_heads + head_dim)
    cache = build_cos_sin_cache(rotary_dim, max_position=8192, base=1_000_000.0, device=device)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).to(device)
    # query and key as strided views of a fused qkv projection
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    expected_q, expected_k = reference_rotary_embedding(positions, query, key, cache)
    rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before), "values must be untouched"


def test_position_zero_is_identity(device: torch.device) -> None:
    cache = build_cos_sin_cache(64, max_position=16, base=10_000.0, device=device)
    q = torch.randn(2, 4, 64, device=device)
    k = torch.randn(2, 2, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(2, dtype=torch.int64, device=device), q, k, cache)
    assert torch.allclose(q, q0) and torch.allclose(k, k0)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_rotary_small(case: tuple, device: torch.device) -> None:
    for dtype in GPU_DTYPES:
        check(*case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_rotary_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(*case, dtype, device)


def test_keys_alone_rotate_with_no_query_heads(device: torch.device) -> None:
    """A query of no heads (a drafter's context keys have no queries) leaves the keys' rotation as it is."""
    cache = build_cos_sin_cache(64, max_position=64, base=10_000.0, device=device)
    positions = torch.tensor([3, 17, 40], device=device)
    key = torch.randn(3, 2, 64, device=device)
    _, expected = reference_rotary_embedding(positions, key.new_empty((3, 1, 64)), key, cache)
    rotary_embedding(positions, key.new_empty((3, 0, 64)), key, cache)
    assert_close(key, expected, torch.float32)


@pytest.mark.parametrize("kind", ["vanilla", None])
def test_a_drafter_rotating_through_the_kernel_drafts_as_with_its_own_rotation(kind, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """DFlash/DSpark drafting takes the platform's rotary where it rotates in float32 from a
    table (one launch a layer): the context keys and the block's drafts are those of the
    drafter's torch rotation."""
    from transformers import LlamaConfig

    from sonar import ops
    from sonar.spec_decode import dflash_model
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
    from sonar_cuda import ops as cuda_ops

    vocab, hidden = 97, 64
    target = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    config = drafter_config_for(target, "deepspec", 5, 2, [1, 2], vocab - 1, markov_rank=8 if kind else 0, markov_head_type=kind, confidence_head=kind is not None)
    drafter = init_drafter(dflash_model.DFlashDrafter(config), std=0.2, seed=1).to(device)
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(2, 6, 2 * hidden, generator=gen).to(device)
    context_positions = torch.arange(6, device=device).expand(2, 6)
    embeds = torch.randn(2, 5, hidden, generator=gen).to(device)
    block_positions = 6 + torch.arange(5, device=device).expand(2, 5)
    masks = [torch.ones(2, 1, 5, 11, dtype=torch.bool, device=device)] * config.num_hidden_layers
    head = torch.randn(vocab, hidden, generator=gen).to(device)

    def draft() -> tuple[list[torch.Tensor], torch.Tensor]:
        with torch.no_grad():
            context = drafter.context(states, context_positions)
            out = drafter.block(embeds, block_positions, context, masks)
            return [k for k, _ in context], drafter.pick_greedy(out @ head.T, out, torch.tensor([1, 2], device=device))[0]

    own_keys, own_drafts = draft()
    monkeypatch.setattr(dflash_model, "FUSED_ROTARY_DEVICES", {device.type})
    ops.register_ops(device.type, {"apply_rotary": cuda_ops.apply_rotary, "rotary_tables": cuda_ops.rotary_tables})
    try:
        with torch.no_grad():
            assert drafter.rotary.tables(block_positions).platform is not None  # the kernel's path was taken
        fused_keys, fused_drafts = draft()
    finally:
        if device.type == "cpu":
            ops.unregister_ops("cpu")
    for own, fused in zip(own_keys, fused_keys):
        torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_drafts, own_drafts)
