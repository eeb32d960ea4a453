"""LoRA adapters at tensor_parallel_size=2 (two real worker processes over gloo): a batch
mixing two peft adapters and the base model gives one device's greedy tokens, and adapters
load, refuse and unload at run time on every rank (one added while a step is in flight). The tiny Qwen3 has one KV head, so k/v's
rows (and their B rows) are replicated on both ranks while q's are split; o and down are
row-parallel (A's columns split, the shrink summed over the ranks, the delta added once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sonar import LLM
from sonar.lora import LoRAError, LoRARequest
from sonar_models.testing import build_tiny_model
from test_lora import make_adapter
from tp_compare import ENGINE, PARAMS, PROMPTS, assert_same_greedy_run, generate

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# async scheduling: a step is still in flight when the next call comes (LoRA calls answer after it)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=True)
EXACT = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LoRARequest]]:
    root = tmp_path_factory.mktemp("tp-lora")
    base = build_tiny_model("qwen3", root / "qwen3", num_key_value_heads=1)
    make_adapter(base, root / "all", ALL, 8, seed=0)
    make_adapter(base, root / "kvo", ["k_proj", "v_proj", "o_proj", "down_proj"], 4, seed=1, use_rslora=True)
    return base, [LoRARequest("all", 1, str(root / "all")), LoRARequest("kvo", 2, str(root / "kvo"))]


def _mixed(llm: LLM, loras: list[LoRARequest]) -> list:
    return generate(llm, lora_request=[loras[0], loras[1], None])  # one prompt each: two adapters and the base


def test_a_batch_mixing_two_adapters_and_the_base_equals_one_device(adapters, tmp_path: Path) -> None:
    base, loras = adapters
    single = LLM(str(base), **ENGINE, **LORA)
    expected = _mixed(single, loras)
    base_only = generate(single)
    del single
    assert [o.outputs[0].token_ids for o in expected] != [o.outputs[0].token_ids for o in base_only]  # the adapters matter
    llm = LLM(str(base), tensor_parallel_size=2, **ENGINE, **LORA)
    engine = llm.llm_engine
    try:
        assert_same_greedy_run(expected, _mixed(llm, loras), EXACT)
        # at run time: an adapter every rank refuses leaves the group serving
        bad = tmp_path / "bad"
        make_adapter(base, bad, ["q_proj"], 4, seed=2)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
        with pytest.raises(LoRAError, match="r=16 is above max_lora_rank=8"):
            engine.add_lora(LoRARequest("bad", 3, str(bad)))
        assert engine.remove_lora(2) is True  # unloaded on both ranks
        assert engine.list_loras() == {1}
        assert_same_greedy_run(expected[:1], generate(llm, [{"prompt_token_ids": PROMPTS[0]}], lora_request=loras[0]), EXACT)
        engine.add_request("late", {"prompt_token_ids": PROMPTS[2]}, PARAMS)
        outputs = engine.step()
        assert engine.core.executor.num_in_flight == 1
        assert engine.add_lora(loras[1]) is True  # and back, while the base request's step runs
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [o for o in outputs if o.finished][0].outputs[0].token_ids == expected[2].outputs[0].token_ids
        assert_same_greedy_run(expected, _mixed(llm, loras), EXACT)
    finally:
        engine.core.executor.shutdown()
