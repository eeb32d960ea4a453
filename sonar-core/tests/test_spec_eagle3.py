"""EAGLE-3 pieces without an engine: the published checkpoint layout, the hidden states a
proposer is handed per request, the draft head's own cache and the training-time-test masks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar.sampler.metadata import RequestSamplingState
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.eagle3_cache import DraftKVCache
from sonar.spec_decode.eagle3_checkpoint import load_eagle3, save_eagle3
from sonar.spec_decode.eagle3_head import Eagle3Config, Eagle3Head
from sonar.spec_decode.eagle3_trainer import _ttt_mask
from sonar.spec_decode.hidden_states import HiddenStateCollector
from sonar.worker.block_table import BlockTable
from sonar.worker.input_batch import CachedRequestState, build_step_batch

# the shapes of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B scaled down: hidden 64, 4 heads of 16, 2 KV heads
CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300, "draft_vocab_size": 40,
    "target_hidden_size": 48, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
}  # fmt: skip
PUBLISHED_LAYOUT = {
    "fc.weight": (64, 3 * 48),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (64, 128),
    "midlayer.self_attn.k_proj.weight": (32, 128),
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (96, 64),
    "midlayer.mlp.up_proj.weight": (96, 64),
    "midlayer.mlp.down_proj.weight": (64, 96),
    "norm.weight": (64,),
    "lm_head.weight": (40, 64),
    "d2t": (40,),
    "t2d": (300,),
}


def write_published_folder(folder, with_embedding: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint folder written by hand in the published layout (not by save_eagle3)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in PUBLISHED_LAYOUT.items()}
    target_ids = torch.arange(40) * 7
    tensors["d2t"] = target_ids - torch.arange(40)
    tensors["t2d"] = torch.zeros(300, dtype=torch.bool)
    tensors["t2d"][target_ids] = True
    if with_embedding:
        tensors["embed_tokens.weight"] = torch.randn(300, 64, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_a_published_layout_folder_loads_tensor_for_tensor(tmp_path):
    tensors = write_published_folder(tmp_path / "head")
    head, embedding = load_eagle3(tmp_path / "head")
    assert embedding is None  # the target's embedding is shared
    assert head.config.aux_layer_ids == (1, 3, 5) and head.config.norm_before_residual
    state = head.state_dict()
    assert set(state) == set(PUBLISHED_LAYOUT)
    for name, tensor in tensors.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    assert head.to_target_ids(torch.tensor([0, 1, 39])).tolist() == [0, 7, 273]


def test_an_own_embedding_is_returned_and_save_writes_the_same_layout(tmp_path):
    tensors = write_published_folder(tmp_path / "head", with_embedding=True)
    head, embedding = load_eagle3(tmp_path / "head")
    assert torch.equal(embedding, tensors["embed_tokens.weight"])
    save_eagle3(head, tmp_path / "again")
    saved = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in saved.items()} == PUBLISHED_LAYOUT
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["draft_vocab_size"], config["target_hidden_size"], config["eagle_aux_hidden_state_layer_ids"]) == (40, 48, [1, 3, 5])


def test_bad_checkpoints_are_refused_naming_what_is_wrong(tmp_path):
    tensors = write_published_folder(tmp_path / "head")
    del tensors["fc.weight"]
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\]"):
        load_eagle3(tmp_path / "head")
    tensors["fc.weight"] = torch.zeros(64, 3 * 48)
    tensors["lm_head.weight"] = torch.zeros(41, 64)
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight is \\[41, 64\\], expected \\[40, 64\\]"):
        load_eagle3(tmp_path / "head")
    (tmp_path / "head" / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_eagle3(tmp_path / "head")
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle3(tmp_path / "nothing")


def _state(req_id: str, tokens: list[int], computed: int, drafts: list[int] | None = None) -> CachedRequestState:
    sampling = RequestSamplingState(params=SamplingParams(), prompt_token_ids=tokens, output_token_ids=[], generator=None, eos_token_ids=[])
    state = CachedRequestState(req_id=req_id, prompt_token_ids=tokens, num_computed_tokens=computed, sampling=sampling)
    state.draft_token_ids = drafts or []
    return state


def test_a_verify_step_hands_over_only_the_kept_positions_and_a_chunk_waits_for_its_request():
    table = BlockTable(8)
    table.add("a", [1, 2])
    table.add("b", [3, 4])
    collector = HiddenStateCollector()
    # step 1: "a" decodes its token 9 (position 9) with 3 drafts; "b" prefills 6 of its 12 prompt tokens
    a, b = _state("a", list(range(10)), 9, drafts=[70, 71, 72]), _state("b", list(range(12)), 0)
    batch = build_step_batch([a, b], [4, 6], table, 16, torch.device("cpu"))
    states = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)  # row r holds r
    step = collector.record(batch, states)
    given = collector.gather(step, ["a"], [2])  # one draft kept: positions 9 and 10 stay
    assert given.counts == [2] and given.positions.tolist() == [9, 10] and given.states[:, 0].tolist() == [0.0, 1.0]
    # step 2: "b" finishes its prompt; its first chunk comes first
    b.num_computed_tokens = 6
    batch = build_step_batch([b], [6], table, 16, torch.device("cpu"))
    step = collector.record(batch, 100 + torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 3))
    given = collector.gather(step, ["b"], [1])
    assert given.counts == [12] and given.positions.tolist() == list(range(12))
    assert given.states[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0] + [100.0 + i for i in range(6)]


def test_a_verify_step_laid_out_one_row_per_token_hands_over_each_requests_own_rows():
    """A decode graph's verify layout gives every token an attention row of its own (the
    metadata's row starts are 0, 1, 2, ...); the states handed over are still each request's
    own rows, found from the tokens each request scheduled."""
    import dataclasses

    table = BlockTable(8)
    table.add("a", [1, 2])
    table.add("b", [3, 4])
    collector = HiddenStateCollector()
    a, b = _state("a", list(range(10)), 9, drafts=[70, 71, 72]), _state("b", list(range(20)), 19, drafts=[80, 81, 82])
    batch = build_step_batch([a, b], [4, 4], table, 16, torch.device("cpu"))
    graph_rows = list(range(9))  # what the graph's metadata says: one row per token
    batch = dataclasses.replace(batch, attn_metadata=dataclasses.replace(batch.attn_metadata, query_start_loc_cpu=graph_rows))
    states = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 3)
    step = collector.record(batch, states)
    given = collector.gather(step, ["a", "b"], [2, 4])  # "a" kept one draft, "b" all three
    assert given.counts == [2, 4]
    assert given.positions.tolist() == [9, 10, 19, 20, 21, 22]
    assert given.states[:, 0].tolist() == [0.0, 1.0, 4.0, 5.0, 6.0, 7.0]


def test_draft_cache_attention_is_causal_over_appended_slots_and_rollback_drops_guesses():
    cache = DraftKVCache(num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(5, 1, 4, generator=gen) for _ in range(3))
    cache.append("r", k[:3], v[:3], commit=True)
    out = cache.attend("r", q[:3, :, :].repeat(1, 2, 1), scale=0.5)  # 2 query heads over 1 KV head
    for i in range(3):
        weights = torch.softmax((q[i, 0] @ k[: i + 1, 0].T) * 0.5, dim=-1)
        assert torch.allclose(out[i, 0], weights @ v[: i + 1, 0], atol=1e-6)
    cache.append("r", k[3:5], v[3:5], commit=False)
    assert cache.lengths["r"] == 5
    cache.rollback("r")
    assert cache.lengths["r"] == 3 and cache.committed["r"] == 3
    cache.append("r", k[3:4] * 0, v[3:4] * 0, commit=True)  # the verified state rewrites position 3
    assert cache.lengths["r"] == 4


def test_training_time_test_masks_follow_the_drafting_order():
    assert _ttt_mask(3, 0, torch.device("cpu")).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # step 1: slot j sees step 0's keys up to j - 1 and its own step-1 key
    assert _ttt_mask(3, 1, torch.device("cpu")).int().tolist() == [[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]]


def test_norm_before_residual_decides_whether_the_residual_is_the_normed_hidden_state():
    hidden, embeds = torch.randn(2, 64), torch.randn(2, 64)
    for flag in (False, True):
        head = Eagle3Head(Eagle3Config.from_dict({**CONFIG, "norm_before_residual": flag, "target_hidden_size": 64}))
        with torch.no_grad():
            head.midlayer.hidden_norm.weight.fill_(2.0)
        _, _, _, residual = head.project(hidden, embeds, torch.tensor([0, 1]))
        expected = head.midlayer.hidden_norm(hidden) if flag else hidden
        assert torch.equal(residual, expected)


def test_a_token_sequence_reads_prompt_and_output_as_one_list_without_copying_them():
    from sonar.spec_decode.worker_side import TokenSequence

    prompt, output = [1, 2, 3], [4, 5]
    joined = TokenSequence(prompt, output)
    assert len(joined) == 5 and list(joined) == [1, 2, 3, 4, 5]
    assert joined[0] == 1 and joined[3] == 4 and joined[-1] == 5 and joined[-5] == 1
    assert joined[2:5] == [3, 4, 5] and joined[5:5] == [] and joined[::-2] == [5, 3, 1]
    output.append(6)  # a view: the output growing shows
    assert len(joined) == 6 and joined[-1] == 6
    with pytest.raises(IndexError):
        joined[6]
