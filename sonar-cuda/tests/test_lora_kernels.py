"""The LoRA shrink and expand kernels against the torch versions of ``sonar.lora.ops``: batches
that mix adapters and tokens without one, fused parts of unequal sizes, ranks, inputs and
outputs that are no powers of two, prefill runs and decode mixes, split inputs, strided views;
the ops' dispatch; the fused single launch of few tokens against shrink then expand; and on
the GPU: Llama-3.1-8B's shapes and capture in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from paged_batch import GPU_DTYPES, dtypes_for

from sonar import ops
from sonar.lora import ops as lora_ops
from sonar.lora.ops import torch_lora_expand, torch_lora_shrink
from sonar_cuda import ops as cuda_ops
from sonar_cuda.kernels.lora import FUSED_A_READS, FUSED_TOKENS, LoRALaunch, fused_launch, lora_expand, lora_shrink, lora_shrink_expand

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
QKV_PARTS = ((0, 40), (40, 64), (64, 88))  # q, k, v of unequal sizes


def adapters(num_slots: int, n: int, k: int, num_out: int, rank: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(num_slots, n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = (torch.randn(num_slots, num_out, rank, generator=gen) / rank**0.5).to(dtype).to(device)
    return a, b


def runs(*pieces: tuple[int, int]) -> torch.Tensor:
    """Token slots from ``(slot, count)`` runs (a prefill batch: each request's tokens in a row)."""
    return torch.cat([torch.full((count,), slot, dtype=torch.int32) for slot, count in pieces])


def check(
    slots: torch.Tensor,
    k: int,
    rank: int,
    parts: tuple[tuple[int, int], ...],
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int = 3,
    shrink_with: LoRALaunch | None = None,
    expand_with: LoRALaunch | None = None,
) -> None:
    num_tokens, num_out = slots.shape[0], max(r1 for _, r1 in parts)
    a, b = adapters(num_slots, len(parts) * rank, k, num_out, rank, dtype, device, seed=num_tokens + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype).to(device)
    out = torch.randn(num_tokens, num_out, generator=gen).to(dtype).to(device)
    slots = slots.to(device)
    none = ((slots < 0) | (slots >= num_slots)).cpu()

    y = lora_shrink(x, a, slots, shrink_with)
    expected_y = torch_lora_shrink(x.float().cpu(), a.float().cpu(), torch.where(none, -1, slots.cpu()))
    assert y.dtype == torch.float32 and y.shape == (num_tokens, len(parts) * rank)
    torch.testing.assert_close(y.cpu(), expected_y, atol=1e-4, rtol=1e-4)
    assert torch.equal(y.cpu()[none], torch.zeros_like(expected_y[none]))

    before = out.clone()
    assert lora_expand(y, b, slots, out, parts, expand_with) is out
    expected = torch_lora_expand(y.to(dtype).float().cpu(), b.float().cpu(), torch.where(none, -1, slots.cpu()), before.float().cpu(), parts)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    assert torch.equal(out.cpu()[none], before.cpu()[none])


DECODE_SLOTS = torch.tensor([2, -1, 0, 0, 1, 2, -1, 1, 0, 2, 2, 1, 3, 0, -1, 1, 2, 0, 1, 1, -1, 2], dtype=torch.int32)  # 3: past the slots


@pytest.mark.parametrize(
    "shrink_with, expand_with",
    [(None, None), (LoRALaunch(16, 16, 32, split_k=3, slot_programs=2), LoRALaunch(16, 32, 16, slot_programs=2))],
    ids=["chosen", "split-inputs-small-blocks-two-slot-programs"],
)
def test_a_decode_mix_of_adapters_over_fused_parts(shrink_with, expand_with, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(DECODE_SLOTS, 72, 12, QKV_PARTS, dtype, device, shrink_with=shrink_with, expand_with=expand_with)


def test_prefill_runs_of_one_adapter_span_blocks(device: torch.device) -> None:
    slots = runs((1, 70), (-1, 9), (0, 50), (2, 21))  # 150 tokens: three blocks of 64, runs across them
    for dtype in dtypes_for(device):
        check(slots, 96, 8, ((0, 72),), dtype, device)


def test_ranks_past_one_dot_step_and_many_parts(device: torch.device) -> None:
    # rank 80: two steps of 64; five parts (one empty): two launches of the expand kernel
    parts = ((0, 20), (20, 36), (36, 36), (36, 57), (57, 70))
    check(runs((0, 5), (1, 4), (-1, 2), (0, 3)), 48, 80, parts, torch.float32, device, num_slots=2)


def test_strided_views_and_rows_outside_the_parts_are_left_alone(device: torch.device) -> None:
    a, b = adapters(2, 2 * 16, 64, 50, 16, torch.float32, device)
    slots = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32, device=device)
    x = torch.randn(5, 80, device=device)[:, 8:72]  # rows of stride 80
    big = torch.randn(5, 70, device=device)
    out = big[:, 10:60]  # [5, 50] inside a wider buffer
    before = big.clone()
    y = lora_shrink(x, a, slots)
    torch.testing.assert_close(y, torch_lora_shrink(x, a, slots), atol=1e-4, rtol=1e-4)
    parts = ((0, 20), (30, 50))  # rows 20:30 belong to no part
    lora_expand(y, b, slots, out, parts)
    expected = torch_lora_expand(y, b, slots, before[:, 10:60].clone(), parts)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(big[:, :10], before[:, :10]) and torch.equal(big[:, 60:], before[:, 60:])
    assert torch.equal(out[:, 20:30], before[:, 30:40])


def test_the_ops_dispatch_to_the_registered_kernels(device: torch.device) -> None:
    a, b = adapters(2, 16, 32, 24, 16, torch.float32, device)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32, device=device)
    x = torch.randn(3, 32, device=device)
    calls: list[str] = []

    def counting(name: str):
        def call(*args):
            calls.append(name)
            return cuda_ops.OPS[name](*args)

        return call

    ops.register_ops(device.type, {"lora_shrink": counting("lora_shrink"), "lora_expand": counting("lora_expand")})
    try:
        y = lora_ops.lora_shrink(x, a, slots)
        out = lora_ops.lora_expand(y, b, slots, torch.zeros(3, 24, device=device), ((0, 24),))
    finally:
        ops.unregister_ops(device.type)
    assert calls == ["lora_shrink", "lora_expand"]
    expected = torch_lora_expand(torch_lora_shrink(x, a, slots), b, slots, torch.zeros(3, 24, device=device), ((0, 24),))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_mismatched_shapes_are_refused_with_what_was_given(device: torch.device) -> None:
    a, b = adapters(2, 16, 32, 24, 16, torch.float32, device)
    x = torch.randn(3, 32, device=device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"a \[S, N, in\]"):
        lora_shrink(torch.randn(3, 40, device=device), a, slots)
    with pytest.raises(ValueError, match="token_slots"):
        lora_shrink(x, a, slots[:2])
    with pytest.raises(ValueError, match="outside the 24 rows"):
        lora_expand(torch.zeros(3, 16, device=device), b, slots, torch.zeros(3, 24, device=device), ((0, 30),))
    with pytest.raises(ValueError, match="2 parts of rank 16"):
        lora_expand(torch.zeros(3, 16, device=device), b, slots, torch.zeros(3, 24, device=device), ((0, 8), (8, 24)))
    with pytest.raises(ValueError, match=r"\(0, 16\) and \(8, 24\) overlap"):
        lora_expand(torch.zeros(3, 32, device=device), b, slots, torch.zeros(3, 24, device=device), ((0, 16), (8, 24)))
    assert lora_shrink(x[:0], a, slots[:0]).shape == (0, 16)


def check_fused(
    slots: torch.Tensor,
    k: int,
    rank: int,
    parts: tuple[tuple[int, int], ...],
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int = 3,
    launch: LoRALaunch | None = None,
) -> None:
    """The fused launch against shrink then expand in float32 from the same weights (the
    kernel keeps the intermediate in float32 and rounds ``out`` once)."""
    num_tokens, num_out = slots.shape[0], max(r1 for _, r1 in parts)
    a, b = adapters(num_slots, len(parts) * rank, k, num_out, rank, dtype, device, seed=num_tokens + k + 1)
    gen = torch.Generator().manual_seed(k + 1)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype).to(device)
    out = torch.randn(num_tokens, num_out, generator=gen).to(dtype).to(device)
    slots = slots.to(device)
    none = ((slots < 0) | (slots >= num_slots)).cpu()
    before = out.clone()
    assert lora_shrink_expand(x, a, b, slots, out, parts, launch) is out
    cpu_slots = torch.where(none, -1, slots.cpu())
    y = torch_lora_shrink(x.float().cpu(), a.float().cpu(), cpu_slots)
    expected = torch_lora_expand(y, b.float().cpu(), cpu_slots, before.float().cpu(), parts)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    assert torch.equal(out.cpu()[none], before.cpu()[none])


def test_fused_batch_of_one_over_unequal_parts(device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check_fused(torch.tensor([2], dtype=torch.int32), 72, 12, QKV_PARTS, dtype, device)
    check_fused(torch.tensor([-1], dtype=torch.int32), 72, 12, QKV_PARTS, torch.float32, device)  # no adapter: untouched


def test_fused_mix_of_adapters_and_tokens_without_one(device: torch.device) -> None:
    slots = DECODE_SLOTS[:13]  # 13 tokens: slots 0-2, -1 and 3 (past the slots)
    for dtype in dtypes_for(device):
        check_fused(slots, 40, 12, ((0, 24), (24, 33)), dtype, device)
    # narrow tiles and steps: several tiles per part, the inputs and the rank (80) in several steps
    check_fused(slots, 100, 80, QKV_PARTS, torch.float32, device, launch=LoRALaunch(16, 16, 32, slot_programs=2, block_r=64))
    # 22 tokens in one block of 32 (the fused launch measured past FUSED_TOKENS)
    check_fused(DECODE_SLOTS, 40, 12, ((0, 24), (24, 33)), torch.float32, device, launch=LoRALaunch(32, 32, 64))


def test_fused_op_dispatch_and_many_tokens_fall_back(device: torch.device) -> None:
    """The op runs the fused kernel where registered and equals the torch version (shrink then
    expand); past ``FUSED_TOKENS`` tokens the kernel runs the two launches."""
    a, b = adapters(2, 32, 48, 40, 16, torch.float32, device)
    parts = ((0, 16), (16, 40))
    for num_tokens in (3, max(FUSED_TOKENS, 16) + 2):
        slots = (torch.arange(num_tokens, dtype=torch.int32) % 3 - 1).to(device)
        x = torch.randn(num_tokens, 48, device=device)
        out = torch.randn(num_tokens, 40, device=device)
        expected = lora_ops.lora_shrink_expand(x, a, b, slots, out.clone(), parts)  # torch versions
        ops.register_ops(device.type, {"lora_shrink_expand": cuda_ops.OPS["lora_shrink_expand"]})
        try:
            got = lora_ops.lora_shrink_expand(x, a, b, slots, out, parts)
        finally:
            ops.unregister_ops(device.type)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="2 parts of rank 16 need 32"):
        lora_shrink_expand(x, a[:, :16], b, slots, out, parts)
    many = torch.zeros(65, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="up to 64 tokens"):
        lora_shrink_expand(torch.zeros(65, 48, device=device), a, b, many, torch.zeros(65, 40, device=device), parts, LoRALaunch(64, 32, 32))


def test_fused_launches_fill_the_gpu_at_llama_8b_shapes() -> None:
    """Up to one program per multiprocessor of an H200 (132) for qkv, o and gate_up, fewer and
    wider tiles for down (every program reads its part's whole A, 14336 x 16 for down), the A
    reads of all programs within ``FUSED_A_READS``."""
    programs = {}
    for layer, (k, parts) in LLAMA_LAYERS.items():
        launch = fused_launch(parts[-1][1], k, 16, 1, 8, torch.bfloat16, torch.device("cpu"))
        programs[layer] = sum(-(-(r1 - r0) // launch.block_n) for r0, r1 in parts)
        assert programs[layer] * 16 * k * 2 <= FUSED_A_READS, layer
    assert programs == {"qkv": 96, "o": 128, "gate_up": 112, "down": 32}
    # 13 tokens of 8 adapters: a program per tile and slot, wider tiles
    k, parts = LLAMA_LAYERS["gate_up"]
    assert fused_launch(parts[-1][1], k, 16, 13, 8, torch.bfloat16, torch.device("cpu")).block_n == 512


# -- GPU: Llama-3.1-8B's projections, rank 16, 8 adapters ---------------------------------

LLAMA_LAYERS = {  # in, parts
    "qkv": (4096, ((0, 4096), (4096, 5120), (5120, 6144))),
    "o": (4096, ((0, 4096),)),
    "gate_up": (4096, ((0, 14336), (14336, 28672))),
    "down": (14336, ((0, 4096),)),
}


def llama_batches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "batch-1": torch.tensor([3], dtype=torch.int32),
        "decode-64": torch.randint(-1, 8, (64,), generator=gen, dtype=torch.int32),
        "decode-200": torch.randint(-1, 8, (200,), generator=gen, dtype=torch.int32),
        "prefill-2048": runs((5, 700), (-1, 300), (0, 1000), (7, 48)),
    }


@pytest.mark.cuda
@pytest.mark.parametrize("layer", LLAMA_LAYERS)
@pytest.mark.parametrize("batch", ["batch-1", "decode-64", "decode-200", "prefill-2048"])
def test_lora_kernels_at_llama_8b_shapes(layer: str, batch: str, device: torch.device) -> None:
    k, parts = LLAMA_LAYERS[layer]
    for dtype in GPU_DTYPES[1:]:
        check(llama_batches()[batch], k, 16, parts, dtype, device, num_slots=8)
    check(llama_batches()[batch][:64], k, 64, parts, torch.bfloat16, device, num_slots=16)


@pytest.mark.cuda
@pytest.mark.parametrize("layer", LLAMA_LAYERS)
def test_fused_lora_at_llama_8b_shapes(layer: str, device: torch.device) -> None:
    k, parts = LLAMA_LAYERS[layer]
    mixed = llama_batches()["decode-64"][:13]
    for slots in (llama_batches()["batch-1"], mixed):
        for dtype in GPU_DTYPES[1:]:
            check_fused(slots, k, 16, parts, dtype, device, num_slots=8)
        check_fused(slots, k, 64, parts, torch.bfloat16, device, num_slots=16)


@pytest.mark.cuda
def test_lora_kernels_capture_in_a_cuda_graph(device: torch.device) -> None:
    k, parts = LLAMA_LAYERS["qkv"]
    a, b = adapters(8, 48, k, 6144, 16, torch.bfloat16, device)
    for num_tokens in (1, 64):
        x = torch.randn(num_tokens, k, device=device, dtype=torch.bfloat16)
        slots = torch.randint(0, 8, (num_tokens,), dtype=torch.int32, device=device)
        out = torch.zeros(num_tokens, 6144, device=device, dtype=torch.bfloat16)
        lora_expand(lora_shrink(x, a, slots), b, slots, out, parts)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.zero_()
            lora_expand(lora_shrink(x, a, slots), b, slots, out, parts)
        for new_slots in (torch.randint(-1, 8, (num_tokens,)), torch.full((num_tokens,), -1)):
            slots.copy_(new_slots)
            graph.replay()
            expected = torch_lora_expand(torch_lora_shrink(x, a, slots), b, slots, torch.zeros_like(out), parts)
            torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_fused_lora_captures_in_a_cuda_graph(device: torch.device) -> None:
    """One fused launch per layer in a graph: slots changed between replays (read on the
    device), tokens without an adapter untouched; down's long inputs too."""
    for layer in ("qkv", "down"):
        k, parts = LLAMA_LAYERS[layer]
        num_out = parts[-1][1]
        a, b = adapters(8, 16 * len(parts), k, num_out, 16, torch.bfloat16, device)
        for num_tokens in (1, 13):
            x = torch.randn(num_tokens, k, device=device, dtype=torch.bfloat16)
            base = torch.randn(num_tokens, num_out, device=device, dtype=torch.bfloat16)
            out = base.clone()
            slots = torch.randint(0, 8, (num_tokens,), dtype=torch.int32, device=device)
            lora_shrink_expand(x, a, b, slots, out, parts)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(base)
                lora_shrink_expand(x, a, b, slots, out, parts)
            for new_slots in (torch.randint(-1, 8, (num_tokens,)), torch.full((num_tokens,), -1)):
                slots.copy_(new_slots)
                graph.replay()
                y = torch_lora_shrink(x.float(), a.float(), slots)
                expected = torch_lora_expand(y, b.float(), slots, base.float(), parts)
                torch.testing.assert_close(out.float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
                assert torch.equal(out[slots < 0], base[slots < 0])


@pytest.mark.cuda
def test_the_shrink_beside_the_base_product_eager_and_in_a_cuda_graph(device: torch.device) -> None:
    """``lora_shrink_begin``: the shrink on the side stream while the base product runs on the
    current one, joined before the expand, gives shrink-then-expand's result; captured in a
    graph (the fork and the join inside it) with slots changed between replays; past
    ``OVERLAP_TOKENS`` tokens it declines."""
    from sonar_cuda.kernels.lora import OVERLAP_TOKENS, lora_shrink_begin

    k, parts = LLAMA_LAYERS["qkv"]
    a, b = adapters(8, 48, k, 6144, 16, torch.bfloat16, device)
    weight = torch.randn(6144, k, device=device, dtype=torch.bfloat16) / k**0.5
    assert lora_shrink_begin(torch.zeros(OVERLAP_TOKENS + 1, k, device=device, dtype=torch.bfloat16), a,
                             torch.zeros(OVERLAP_TOKENS + 1, dtype=torch.int32, device=device)) is None  # fmt: skip

    def layer(x: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        join = lora_shrink_begin(x, a, slots)
        assert join is not None
        out.copy_(x @ weight.T)  # the base product, on the current stream meanwhile
        lora_expand(join(), b, slots, out, parts)

    for num_tokens in (1, 9, OVERLAP_TOKENS):
        x = torch.randn(num_tokens, k, device=device, dtype=torch.bfloat16)
        slots = torch.randint(-1, 8, (num_tokens,), dtype=torch.int32, device=device)
        out = torch.empty(num_tokens, 6144, device=device, dtype=torch.bfloat16)

        def expected() -> torch.Tensor:
            base = (x @ weight.T).float()
            return torch_lora_expand(torch_lora_shrink(x.float(), a.float(), slots), b.float(), slots, base, parts)

        layer(x, slots, out)  # eager (and compiles outside the capture)
        torch.testing.assert_close(out.float(), expected(), atol=3e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, slots, out)
        for new_slots in (torch.randint(-1, 8, (num_tokens,)), torch.full((num_tokens,), -1)):
            slots.copy_(new_slots)
            x.normal_()
            graph.replay()
            torch.testing.assert_close(out.float(), expected(), atol=3e-2, rtol=2e-2)
