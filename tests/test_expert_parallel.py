"""Mixture-of-experts models over two CPU ranks (gloo, real worker processes): with every
expert's intermediate size split over the ranks (TP=2) and with whole experts per rank
(``enable_expert_parallel``, EP=2), greedy tokens equal one device's (itself tested equal to
transformers in ``sonar-models/tests``), logprobs within 1e-3. In process: the shard each rank
loads from both checkpoint layouts, the expert map, the routing reaching both ranks' experts,
and what is refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sonar import LLM, SamplingParams
from sonar.distributed import Communicator, ParallelGroup, building_for
from sonar.moe import fused_moe
from sonar_models.expert_parallel import expert_placement, token_slice
from sonar_models.moe import SparseMoeBlock
from sonar_models.testing import MOE_ARCHS, PagedCacheDriver, build_tiny_model, load_sonar_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13], [5, 900, 17, 3, 44, 8, 2, 19, 6, 33, 71]]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
ENGINE = dict(kv_cache_memory_bytes=1 << 24, max_model_len=128, max_num_seqs=8)
MODES = {"tp": False, "ep": True}  # mode -> enable_expert_parallel, both at tensor_parallel_size=2


def _generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: build_tiny_model(arch, tmp_path_factory.mktemp(arch)) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def runs(paths: dict[str, Path]) -> dict[tuple[str, str], list]:
    """Per architecture: the outputs on one device, at TP=2 and at EP=2; and of one request
    alone, whose decode steps leave rank 1 no token of its own at EP=2."""
    results = {}
    for arch, path in paths.items():
        single = LLM(str(path), **ENGINE)
        results[arch, "one"], results[arch, "one alone"] = _generate(single), _generate(single, PROMPTS[:1])
        for mode, expert_parallel in MODES.items():
            llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
            try:
                results[arch, mode] = _generate(llm)
                if expert_parallel:
                    results[arch, "ep alone"] = _generate(llm, PROMPTS[:1])
            finally:
                llm.llm_engine.shutdown()
    return results


@pytest.mark.parametrize("mode", [*MODES, "ep alone"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_two_ranks_match_one_device(runs: dict, arch: str, mode: str) -> None:
    reference = runs[arch, "one alone" if mode.endswith("alone") else "one"]
    for one, two in zip(reference, runs[arch, mode], strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            assert set(a) == set(b)
            for token_id, logprob in a.items():
                assert b[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_prompts_route_to_experts_of_both_ranks(paths: dict, arch: str) -> None:
    """In the step that prefills the prompts together (as the engine's first step does), every
    sparse layer's tokens choose experts of rank 0 (the first half) and of rank 1, and each
    rank's slice of the tokens sends some to the other rank: the EP run above exchanged
    tokens both ways."""
    model = load_sonar_model(paths[arch])
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    chosen: list[list[torch.Tensor]] = [[] for _ in blocks]
    for block, record in zip(blocks, chosen):
        block.route = _recording(block.route, record)
    PagedCacheDriver(model, block_size=4).step(model, list(enumerate(PROMPTS)))
    half = blocks[0].experts.num_experts // 2
    for record in chosen:
        assert len(record) == 1
        for ids in record:
            owners = ids // half  # [T, k] the EP=2 rank of each choice
            assert set(owners.flatten().tolist()) == {0, 1}
            for rank in (0, 1):  # the rank's own tokens reach the other rank's experts
                mine = owners[token_slice(ids.shape[0], ParallelGroup(rank, 2, Communicator(2), expert_parallel=True))]
                assert (mine != rank).any()


def _recording(route, record: list[torch.Tensor]):
    def recorded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(x)
        record.append(ids)
        return weights, ids

    return recorded


def _stacked_copy(source: Path, target: Path) -> Path:
    """The same model in transformers' in-memory layout (``mlp.experts.gate_up_proj [E, 2I, H]``)."""
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((source / name).read_bytes())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, target / "model.safetensors")
    return target


def test_each_rank_loads_its_shard_from_both_layouts(paths: dict, tmp_path: Path) -> None:
    """TP: every expert's gate rows, up rows and down columns of the rank's slice of the
    intermediate size; EP: the rank's whole experts only, and an expert map to them."""
    per_expert = paths["mixtral"]
    stacked = _stacked_copy(per_expert, tmp_path / "stacked")
    full = load_sonar_model(per_expert).model.layers[0].mlp.experts
    size, num_experts = full.intermediate_size, full.num_experts
    half, experts_half = size // 2, num_experts // 2
    for folder in (per_expert, stacked):
        for rank in (0, 1):
            for expert_parallel in (False, True):
                with building_for(ParallelGroup(rank, 2, Communicator(2), expert_parallel=expert_parallel)):
                    experts = load_sonar_model(folder).model.layers[0].mlp.experts
                if expert_parallel:
                    held = slice(rank * experts_half, (rank + 1) * experts_half)
                    assert torch.equal(experts.w13, full.w13[held]) and torch.equal(experts.w2, full.w2[held])
                    expected_map = [-1] * num_experts
                    expected_map[held] = range(experts_half)
                    assert experts.expert_map.tolist() == expected_map
                else:
                    cols = slice(rank * half, (rank + 1) * half)
                    gate, up = full.w13[:, :size][:, cols], full.w13[:, size:][:, cols]
                    assert torch.equal(experts.w13, torch.cat([gate, up], dim=1))
                    assert torch.equal(experts.w2, full.w2[:, :, cols])
                    assert experts.expert_map is None


def test_each_rank_s_experts_add_up_to_all_of_them() -> None:
    """``fused_moe`` with an expert map: pairs of experts held elsewhere add nothing, so the
    ranks' outputs sum to the one-device output (also with a token choosing one expert twice)."""
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(9, 16, generator=gen), torch.randn(6, 24, 16, generator=gen), torch.randn(6, 16, 12, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(9, 6, generator=gen), -1), 3, dim=-1)
    ids[0] = torch.tensor([5, 5, 0])
    parts = []
    for rank in range(3):
        placement = expert_placement(6, ParallelGroup(rank, 3, Communicator(3), expert_parallel=True))
        held = slice(placement.first, placement.first + placement.count)
        parts.append(fused_moe(x, w13[held], w2[held], weights, ids, placement.expert_map()))
    torch.testing.assert_close(sum(parts), fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert fused_moe(x[:0], w13[:2], w2[:2], weights[:0], ids[:0], placement.expert_map()).shape == (0, 16)  # a rank given no tokens


def test_token_slices_cover_the_step_once() -> None:
    for num_tokens in (0, 1, 5, 8):
        rows = [list(range(num_tokens))[token_slice(num_tokens, ParallelGroup(r, 3, Communicator(3)))] for r in range(3)]
        assert sum(rows, []) == list(range(num_tokens))
        assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_what_expert_parallelism_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the model has 6 experts per layer; choose a tensor_parallel_size that divides 6"):
        expert_placement(6, ParallelGroup(0, 4, Communicator(4), expert_parallel=True))
    dense = build_tiny_model("qwen3", tmp_path / "dense")
    with pytest.raises(ValueError, match="enable_expert_parallel splits the experts .* Qwen3ForCausalLM has none"):
        LLM(str(dense), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)  # before any process starts
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        LLM(str(dense), enable_expert_parallel="yes")


def test_the_flag_and_its_short_form() -> None:
    from sonar.cli.engine_args import add_engine_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for flag in ("--enable-expert-parallel", "-ep"):
        args = engine_args_from(parser.parse_args(["model", "-tp", "2", flag]))
        assert args.enable_expert_parallel and args.tensor_parallel_size == 2
    assert not engine_args_from(parser.parse_args(["model"])).enable_expert_parallel
