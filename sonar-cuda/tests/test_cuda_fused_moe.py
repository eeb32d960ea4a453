"""The fused MoE kernel (two grouped GEMMs over pairs sorted by expert) against the torch
version of ``sonar.moe.fused_moe``; the interpreter runs the small shapes on CPU."""

from __future__ import annotations

import pytest
import torch
from paged_batch import TOLERANCE, dtypes_for

from sonar.moe import torch_fused_moe
from sonar_cuda.kernels import fused_moe as fused_moe_module
from sonar_cuda.kernels.fused_moe import MoELaunch, align_by_expert, fused_moe, loop_over_experts

# (num_tokens, num_experts, top_k, hidden, intermediate): uneven sizes exercise the masks
SMALL_CASES = [(1, 4, 2, 64, 32), (7, 8, 2, 48, 40), (33, 4, 1, 32, 32)]
# Qwen3-30B-A3B's layer (128 experts, top 8, hidden 2048, intermediate 768) and Mixtral's shape class
LARGE_CASES = [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (1000, 128, 8, 2048, 768), (300, 8, 2, 1024, 3584)]


def make_case(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    tensors = (x.to(dtype), w13.to(dtype), w2.to(dtype))
    return *(t.to(device) for t in tensors), weights.to(device), ids.to(device)


def check(case: tuple, dtype: torch.dtype, device: torch.device, launch: MoELaunch | None = None) -> None:
    x, w13, w2, weights, ids = make_case(*case, dtype, device)
    out = fused_moe(x, w13, w2, weights, ids, launch)
    assert out.shape == x.shape and out.dtype == dtype
    expected = torch_fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("way", ["kernel", "sort"])
def test_pairs_are_grouped_by_expert_in_padded_blocks(way: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    if way == "sort":
        monkeypatch.setattr(fused_moe_module, "ALIGN_KERNEL_MAX_PAIRS", 0)
    ids = torch.tensor([[3, 0], [0, 2], [3, 0], [1, 0]], device=device)  # experts 0 (4 pairs), 1, 2, 3 (2 pairs)
    sorted_pairs, block_experts = align_by_expert(ids, num_experts=5, block_m=4)
    pad = ids.numel()
    # room for min(5 experts, 8 pairs) padded runs: ceil((8 + 5 * 3) / 4) = 6 blocks, the last two unused
    assert block_experts.tolist() == [0, 1, 2, 3, 5, 5]
    assert sorted_pairs.tolist() == [1, 2, 5, 7, 6, pad, pad, pad, 3, pad, pad, pad, 0, 4] + [pad] * 10
    flat = ids.reshape(-1)
    for block, expert in enumerate(block_experts.tolist()):
        pairs = [p for p in sorted_pairs[block * 4 : block * 4 + 4].tolist() if p < pad]
        assert all(int(flat[p]) == expert for p in pairs)


@pytest.mark.parametrize("shape", [(1, 128, 8, 16), (37, 8, 2, 16), (100, 128, 8, 32), (50, 3, 3, 64)])
def test_the_alignment_kernel_equals_the_sort(shape: tuple, device: torch.device) -> None:
    num_tokens, num_experts, top_k, block_m = shape
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int().to(device)
    num_blocks = -(-(num_tokens * top_k + min(num_experts, num_tokens * top_k) * (block_m - 1)) // block_m)
    by_kernel = align_by_expert(ids, num_experts, block_m)
    by_sort = fused_moe_module._align_by_sorting(ids, num_experts, block_m, num_blocks)
    assert torch.equal(by_kernel[0], by_sort[0]) and torch.equal(by_kernel[1], by_sort[1])


@pytest.mark.parametrize("case", SMALL_CASES)
def test_fused_moe_small(case: tuple, device: torch.device) -> None:
    for dtype in dtypes_for(device):
        check(case, dtype, device)


@pytest.mark.parametrize("way", ["kernel", "sort"])
def test_pairs_of_experts_held_elsewhere_are_placed_nowhere(way: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert parallelism: id ``num_experts`` (held by another rank) gets no run and no block."""
    if way == "sort":
        monkeypatch.setattr(fused_moe_module, "ALIGN_KERNEL_MAX_PAIRS", 0)
    ids = torch.tensor([[2, 0], [0, 2], [1, 2]], device=device)  # 2: elsewhere; experts 0 (2 pairs), 1 (1 pair)
    sorted_pairs, block_experts = align_by_expert(ids, num_experts=2, block_m=4)
    pad = ids.numel()
    assert block_experts.tolist() == [0, 1] + [2] * (len(block_experts) - 2)
    assert sorted_pairs.tolist() == [1, 2, pad, pad, 4, pad, pad, pad] + [pad] * (len(sorted_pairs) - 8)


@pytest.mark.parametrize("case", SMALL_CASES)
def test_each_rank_s_experts_through_an_expert_map(case: tuple, device: torch.device) -> None:
    """With ``expert_map`` the kernel runs only the rank's experts, as the torch version does;
    the two ranks' outputs add up to the whole layer's."""
    x, w13, w2, weights, ids = make_case(*case, torch.float32, device)
    num_experts = w13.shape[0]
    half = num_experts // 2
    outputs = []
    for held in (slice(0, half), slice(half, num_experts)):
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        expert_map[held] = torch.arange(half, dtype=torch.int32, device=device)
        out = fused_moe(x, w13[held], w2[held], weights, ids, expert_map=expert_map)
        torch.testing.assert_close(out, torch_fused_moe(x, w13[held], w2[held], weights, ids, expert_map), atol=2e-4, rtol=2e-4)
        outputs.append(out)
    torch.testing.assert_close(outputs[0] + outputs[1], torch_fused_moe(x, w13, w2, weights, ids), atol=2e-4, rtol=2e-4)


def test_loop_baseline_equals_the_torch_version() -> None:
    x, w13, w2, weights, ids = make_case(*SMALL_CASES[1], torch.float32, torch.device("cpu"))
    torch.testing.assert_close(loop_over_experts(x, w13, w2, weights, ids), torch_fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_no_tokens(device: torch.device) -> None:
    x, w13, w2, weights, ids = make_case(1, 4, 2, 32, 32, torch.float32, device)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_shapes_that_do_not_fit_are_refused(device: torch.device) -> None:
    x, w13, w2, weights, ids = make_case(3, 4, 2, 32, 32, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x[:, :16], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def test_the_op_behind_sonar_moe_is_the_kernel(device: torch.device) -> None:
    """``sonar.moe.fused_moe`` reaches the kernel once the platform's ops are registered."""
    from sonar import moe, ops
    from sonar_cuda.ops import OPS

    assert OPS["fused_moe"] is fused_moe
    x, w13, w2, weights, ids = make_case(*SMALL_CASES[1], torch.float32, device)
    calls = []
    ops.register_ops(device.type, {"fused_moe": lambda *args: calls.append(args) or OPS["fused_moe"](*args)})
    try:
        out = moe.fused_moe(x, w13, w2, weights, ids)
    finally:
        ops.unregister_ops(device.type)
    assert len(calls) == 1
    torch.testing.assert_close(out, torch_fused_moe(x, w13, w2, weights, ids), atol=2e-4, rtol=2e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", LARGE_CASES)
def test_fused_moe_large(case: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check(case, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("launch", [MoELaunch(16, 64, 128), MoELaunch(32, 64, 64), MoELaunch(64, 128, 64, 8, 3)])
def test_every_launch_gives_the_same_result(launch: MoELaunch, device: torch.device) -> None:
    check((256, 128, 8, 2048, 768), torch.bfloat16, device, launch)


@pytest.mark.cuda
def test_a_cuda_graph_captures_the_whole_layer(device: torch.device) -> None:
    """Sort, alignment and both GEMMs replay from a graph: no host read of the routing."""
    x, w13, w2, weights, ids = make_case(8, 128, 8, 2048, 768, torch.bfloat16, device)
    expected = fused_moe(x, w13, w2, weights, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, weights, ids)  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_x, _, _, new_weights, new_ids = make_case(8, 128, 8, 2048, 768, torch.bfloat16, device)
    new_x, new_ids = new_x.flip(0), new_ids.flip(0)
    x.copy_(new_x), weights.copy_(new_weights.flip(0)), ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids))
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("arch", ["qwen3_moe"])  # Mixtral's float32 routing weights: SMALL_CASES
def test_models_with_the_kernel_match_transformers(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny MoE model with the kernel behind ``sonar.moe.fused_moe`` (interpreted on CPU)."""
    from engine_helpers import use_tokenizer_folder_if_needed
    from transformers import AutoModelForCausalLM

    from sonar import ops
    from sonar_models.testing import PagedCacheDriver, build_tiny_model, load_sonar_model

    if torch.cuda.is_available():
        pytest.skip("CPU-only: Triton's interpreter is off where a GPU is present")
    use_tokenizer_folder_if_needed()
    path = build_tiny_model(arch, tmp_path_factory.mktemp("moe") / arch)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 1345, 314]
    model = load_sonar_model(path)
    ops.register_ops("cpu", {"fused_moe": fused_moe})
    try:
        ours = model.compute_logits(PagedCacheDriver(model, block_size=4).step(model, [(0, prompt)]))
    finally:
        ops.unregister_ops("cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def _fp8_case(case: tuple, device: torch.device, per_tensor_up: bool = False):
    """FP8 experts with one scale per output row (gate's per tensor where ``per_tensor_up``)
    and their dequantized float32 weights."""
    from sonar.quantization.fp8 import quantize_per_row

    x, w13, w2, weights, ids = make_case(*case, torch.float32, device)
    q13, s13 = zip(*(quantize_per_row(w) for w in w13.cpu()))
    q2, s2 = zip(*(quantize_per_row(w) for w in w2.cpu()))
    q13, s13, q2, s2 = (torch.stack(t).to(device) for t in (q13, s13, q2, s2))
    return x, q13, q2, s13.float(), s2.float(), weights, ids


@pytest.mark.parametrize("case", SMALL_CASES)
def test_fp8_experts_with_row_scales(case: tuple, device: torch.device) -> None:
    from sonar_cuda.kernels.fused_moe import fused_moe_fp8

    x, q13, q2, s13, s2, weights, ids = _fp8_case(case, device)
    dequantized = (q13.float() * s13[:, :, None], q2.float() * s2[:, :, None])
    for dtype in dtypes_for(device):
        out = fused_moe_fp8(x.to(dtype), q13, q2, s13, s2, weights, ids)
        assert out.shape == x.shape and out.dtype == dtype
        expected = torch_fused_moe(x.to(dtype).float(), *dequantized, weights, ids)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_an_fp8_checkpoint_s_experts_run_in_the_kernel_as_on_the_cpu(device: torch.device) -> None:
    """``Fp8ExpertsMethod`` stacks a layer's FP8 experts for the kernel (a per-tensor scale
    repeated per row) and gives what its CPU path gives."""
    from types import SimpleNamespace

    from sonar.quantization.fp8 import Fp8ExpertsMethod, quantize_per_row, to_fp8
    from sonar_cuda.kernels.fused_moe import fused_moe_fp8

    num_tokens, num_experts, top_k, hidden, intermediate = SMALL_CASES[1]
    x, w13, w2, weights, ids = make_case(*SMALL_CASES[1], torch.float32, torch.device("cpu"))
    method = Fp8ExpertsMethod()
    layer = SimpleNamespace(split_intermediate=False, expert_map=None)
    method.create_weights(layer, num_experts, hidden, intermediate)
    for e in range(num_experts):
        gate, up = w13[e].chunk(2)
        for name, weight in (("gate", gate), ("up", up), ("down", w2[e])):
            if name == "up":  # per tensor
                scale = (weight.abs().amax() / 448.0).reshape(1)
                q = to_fp8(weight, scale)
            else:
                q, scale = quantize_per_row(weight)
                scale = scale[:, None]
            method.load_checkpoint_part(layer, "w13", q, (e, name, "weight"))
            method.load_checkpoint_part(layer, "w13", scale, (e, name, "weight_scale"))
    on_the_cpu = method.apply(layer, x, weights, ids)
    method._stack(layer, fused_moe_fp8)
    assert layer.fp8_experts is None and layer.w13.dtype == torch.float8_e4m3fn and layer.w13_scale.shape == (num_experts, 2 * intermediate)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        setattr(layer, name, getattr(layer, name).to(device))
    out = method.apply(layer, x.to(device), weights.to(device), ids.to(device))
    torch.testing.assert_close(out.cpu(), on_the_cpu, atol=1e-4, rtol=1e-4)


def _block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as FP8 with a scale per ``block`` (the last ones partial), as HF's
    ``fp8`` checkpoints hold it: ``(weight, weight_scale_inv [ceil(N / bn), ceil(K / bk)])``."""
    from sonar.quantization.fp8 import to_fp8

    (n, k), (bn, bk) = weight.shape, block
    padded = torch.nn.functional.pad(weight, (0, -k % bk, 0, -n % bn))
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    return to_fp8(blocks, scale[:, None, :, None]).reshape(padded.shape)[:n, :k], scale


def _block_case(case: tuple, block: tuple[int, int]):
    """FP8 experts with block scales, stacked as ``fused_moe_fp8`` takes them, and their
    dequantized float32 weights; the per-expert parts too."""
    from sonar.quantization.fp8 import dequantize_blocks

    x, w13, w2, weights, ids = make_case(*case, torch.float32, torch.device("cpu"))
    parts = [[_block_quantize(w, block) for w in (*w13[e].chunk(2), w2[e])] for e in range(w13.shape[0])]
    q13 = torch.stack([torch.cat([gate[0], up[0]]) for gate, up, _ in parts])
    s13 = torch.stack([torch.cat([gate[1], up[1]]) for gate, up, _ in parts])
    q2, s2 = torch.stack([down[0] for *_, down in parts]), torch.stack([down[1] for *_, down in parts])
    d13 = torch.stack([torch.cat([dequantize_blocks(*gate, block), dequantize_blocks(*up, block)]) for gate, up, _ in parts])
    d2 = torch.stack([dequantize_blocks(*down, block) for *_, down in parts])
    return x, q13, q2, s13, s2, d13, d2, weights, ids, parts


@pytest.mark.parametrize(
    "case, block", [*((case, (16, 16)) for case in SMALL_CASES), ((3, 4, 2, 256, 192), (128, 128))]
)
def test_fp8_experts_with_block_scales(case: tuple, block: tuple[int, int], device: torch.device) -> None:
    """Blocks over widths that leave partial blocks (40 = 2.5 blocks of 16, 192 = 1.5 of 128),
    with tiles of inputs smaller than a block (64 of 128 in the interpreter): each weight tile
    times its block's scale as it is read."""
    from sonar_cuda.kernels.fused_moe import fused_moe_fp8

    x, q13, q2, s13, s2, d13, d2, weights, ids, _ = _block_case(case, block)
    args = [t.to(device) for t in (q13, q2, s13, s2, weights, ids)]
    for dtype in dtypes_for(device):
        out = fused_moe_fp8(x.to(dtype).to(device), *args[:4], args[4], args[5], block=block)
        assert out.shape == x.shape and out.dtype == dtype
        expected = torch_fused_moe(x.to(dtype).float(), d13, d2, weights, ids)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_fp8(x.to(device), *args[:2], args[2][:, :-1], args[3], args[4], args[5], block=block)


def test_a_block_scaled_fp8_checkpoint_s_experts_run_in_the_kernel_as_on_the_cpu(device: torch.device) -> None:
    """``Fp8ExpertsMethod`` with block scales stacks the experts' blocks for the kernel and
    gives what its CPU path (each expert dequantized per call) gives."""
    from types import SimpleNamespace

    from sonar.quantization.fp8 import Fp8ExpertsMethod
    from sonar_cuda.kernels.fused_moe import fused_moe_fp8

    case, block = SMALL_CASES[1], (16, 16)
    num_tokens, num_experts, top_k, hidden, intermediate = case
    x, *_, weights, ids, parts = _block_case(case, block)
    method = Fp8ExpertsMethod(block=block)
    layer = SimpleNamespace(split_intermediate=False, expert_map=None)
    method.create_weights(layer, num_experts, hidden, intermediate)
    for e, expert in enumerate(parts):
        for name, (q, scale) in zip(("gate", "up", "down"), expert):
            method.load_checkpoint_part(layer, "w13", q, (e, name, "weight"))
            method.load_checkpoint_part(layer, "w13", scale, (e, name, "weight_scale_inv"))
    on_the_cpu = method.apply(layer, x, weights, ids)
    method._stack(layer, fused_moe_fp8)
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w13_scale.shape == (num_experts, 2 * -(-intermediate // 16), -(-hidden // 16))
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        setattr(layer, name, getattr(layer, name).to(device))
    out = method.apply(layer, x.to(device), weights.to(device), ids.to(device))
    torch.testing.assert_close(out.cpu(), on_the_cpu, atol=1e-4, rtol=1e-4)
