"""EAGLE-3 with real tiny targets: the auxiliary hidden states equal transformers' hidden
states of those layers; the proposer's cached, rolled-back drafting equals drafting from
scratch; greedy output with the eagle3 method is token for token the output without
speculation (mixed batches, chunked prefill, preemption)."""

from __future__ import annotations

import pytest
import torch

from sonar import LLM, SamplingParams
from sonar.spec_decode import ProposerInputs, SpeculativeConfig
from sonar.spec_decode.draft_graphs import ReplayCapturer
from sonar.spec_decode.eagle3 import Eagle3Proposer
from sonar.spec_decode.eagle3_checkpoint import read_eagle3_config, save_eagle3
from sonar.spec_decode.eagle3_head import Eagle3Head
from sonar.spec_decode.eagle3_trainer import head_config_for
from sonar.spec_decode.interface import DraftCacheBudget
from sonar.spec_decode.paged_draft_cache import PagedDraftCache
from sonar_models.aux_hidden_states import default_aux_layer_ids
from sonar_models.testing import PagedCacheDriver, load_sonar_model

KV_BYTES = 2**23
LAYERS = 4


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir, tmp_path_factory):
    from sonar_models.testing import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("eagle3-target") / "llama4", num_hidden_layers=LAYERS)


def random_head(target_dir, folder, draft_vocab: int = 512, seed: int = 0):
    """A random EAGLE-3 head for the target, saved in the published layout."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    head = Eagle3Head(head_config_for(AutoConfig.from_pretrained(target_dir), draft_vocab, [1, 2, 3]))
    ids = torch.arange(draft_vocab) * 3 + 5
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d[ids] = True
    return save_eagle3(head, folder)


def test_default_aux_layers_are_eagle3s_and_distinct_on_shallow_models():
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(4) == (1, 2, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_aux_hidden_states_equal_transformers_hidden_states_of_those_layers(tiny_model_dir, tmp_path, arch):
    from sonar_models.testing import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(arch, tmp_path / arch, num_hidden_layers=LAYERS)
    model = load_sonar_model(path)
    prompt = [(i * 31) % 3000 + 100 for i in range(13)]
    driver = PagedCacheDriver(model)
    driver.step(model, [(0, prompt[:5])])
    assert model.aux_hidden_states.latest is None  # nothing chosen: nothing kept
    model.aux_hidden_states.select([3, 0, 2])
    driver.step(model, [(0, prompt[5:])])
    latest = model.aux_hidden_states.latest  # [8, 3 * 64], layers in ascending order
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0, 5:] for i in (0, 2, 3)], dim=-1)
    assert latest.shape == (8, 3 * 64)
    assert torch.allclose(latest, expected, atol=1e-4)


def _reference_drafts(proposer: Eagle3Proposer, states: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """Drafting from scratch: every slot recomputed with full causal attention, no cache."""
    head, embed = proposer.head, proposer.embed
    hidden = head.combine(states)  # slot j: the target's state at j and the token at j + 1
    ids = tokens[1 : len(states) + 1]
    drafts = []
    for _ in range(k):
        q, key, value, residual = head.project(hidden, embed(torch.tensor(ids)), torch.arange(len(ids)))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True, scale=head.config.head_dim**-0.5, enable_gqa=True
        ).transpose(0, 1)
        normed, prenorm = head.finish(out, residual)
        drafts.append(int(head.to_target_ids(head.logits(normed[-1:]).argmax(-1))))
        hidden = torch.cat([hidden, prenorm[-1:]])  # the head's own state, then its draft
        ids = ids + [drafts[-1]]
    return drafts


@torch.inference_mode()
def test_cached_drafting_with_rollback_equals_drafting_from_scratch(target_dir, tmp_path):
    folder = random_head(target_dir, tmp_path / "head")
    target = load_sonar_model(target_dir)
    k = 4
    proposer = Eagle3Proposer(SpeculativeConfig("eagle3", k, model=str(folder)), torch.device("cpu"))
    proposer.load_model(target)
    assert target.aux_hidden_states.ordered_ids == [1, 2, 3]
    gen = torch.Generator().manual_seed(1)
    all_states = torch.randn(40, 3 * 64, generator=gen)
    tokens = [(i * 17) % 1500 + 5 for i in range(12)]  # prompt of 11 + the first sampled token
    handed, num_accepted = 0, 1
    for kept in (2, 0, 3, 1):  # a prefill, then verify steps that keep 2, 0, 3 drafts
        count = len(tokens) - 1 - handed
        inputs = ProposerInputs(
            ["r"], [list(tokens)], [num_accepted],
            hidden_states=all_states[handed : handed + count], positions=torch.arange(handed, handed + count), num_hidden_states=[count],
        )
        drafts = proposer.propose(inputs).token_ids[0]
        assert len(drafts) == k
        assert drafts == _reference_drafts(proposer, all_states[: len(tokens) - 1], tokens, k)
        handed += count
        tokens += drafts[:kept] + [(len(tokens) * 29) % 1500 + 5]  # the kept drafts and the target's own token
        num_accepted = kept + 1
    assert proposer.cache.committed["r"] == handed
    proposer.remove_requests({"r"})
    assert "r" not in proposer.cache.lengths


@torch.inference_mode()
def test_a_batch_drafts_as_each_alone_and_as_a_padded_pass(target_dir, tmp_path):
    folder = random_head(target_dir, tmp_path / "head")
    target = load_sonar_model(target_dir)
    config = SpeculativeConfig("eagle3", 4, model=str(folder))
    gen = torch.Generator().manual_seed(2)
    seqs = {"a": [(i * 7) % 900 + 11 for i in range(9)], "b": [(i * 5) % 700 + 3 for i in range(23)], "c": [17, 23]}
    states = {r: torch.randn(len(t) - 1, 3 * 64, generator=gen) for r, t in seqs.items()}

    def inputs(req_ids):
        counts = [len(seqs[r]) - 1 for r in req_ids]
        return ProposerInputs(
            list(req_ids), [seqs[r] for r in req_ids], [1] * len(req_ids), hidden_states=torch.cat([states[r] for r in req_ids]),
            positions=torch.cat([torch.arange(n) for n in counts]), num_hidden_states=counts,
        )  # fmt: skip

    def proposer(capturer=None):
        built = Eagle3Proposer(config, torch.device("cpu"))
        built.load_model(target)
        if capturer is not None:  # the drafting pass at padded sizes and slot buckets, as a graph replays it
            built.init_cache(DraftCacheBudget(num_target_blocks=8, block_size=16, max_num_seqs=4, max_model_len=64, capturer=capturer))
        return built

    alone = {r: proposer().propose(inputs([r])).token_ids[0] for r in seqs}
    together = proposer().propose(inputs(["b", "a", "c"])).token_ids
    assert together == [alone[r] for r in ("b", "a", "c")]
    capturer = ReplayCapturer()
    padded = proposer(capturer)
    assert capturer.num_captured == 3 * 4 + 4 and padded.draft_pass.shape_for(3, 22 + 3) == (4, 32)  # 16 .. 80 slots: 64 + 3 guesses
    assert padded.context_pass.sizes == [8, 16, 32, 64] and padded.context_pass.shape_for(31, 0) == (32, 0)  # the states, padded
    assert padded.propose(inputs(["b", "a", "c"])).token_ids == together
    assert padded.cache.lengths == padded.cache.committed == {"a": 8, "b": 22, "c": 1}  # the guessed slots were not kept


def _generate(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_greedy_output_with_eagle3_equals_no_speculation(target_dir, tmp_path):
    folder = random_head(target_dir, tmp_path / "head")
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(20 + 9 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)  # decodes without drafts
    expected = _generate(LLM(str(target_dir), kv_cache_memory_bytes=KV_BYTES), prompts, params)
    # chunked prefill (16-token chunks) and a cache small enough to preempt
    head = read_eagle3_config(folder)  # the head's own paged cache comes out of the same budget
    block_bytes = 2 * LAYERS * 16 * 2 * 16 * 4 + 16 * PagedDraftCache.bytes_per_slot(1, head.num_key_value_heads, head.head_dim, torch.float32)
    llm = LLM(str(target_dir), kv_cache_memory_bytes=10 * block_bytes, max_num_batched_tokens=16, max_model_len=128, speculative_config=spec)
    got = _generate(llm, prompts, params)
    stats = llm.llm_engine.get_stats()
    assert got == expected
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= 3 * stats.spec_num_drafts - 3 * len(prompts)
    assert stats.num_preemptions > 0


def test_eagle3_config_is_checked_when_the_engine_is_configured(target_dir, tmp_path):
    with pytest.raises(ValueError, match='needs "model"'):
        LLM(str(target_dir), speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(target_dir), speculative_config={"method": "eagle3", "model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        LLM(str(target_dir), speculative_config={"method": "eagle3", "model": str(target_dir)})


@pytest.mark.cuda
def test_cuda_greedy_with_eagle3_equals_without(target_dir, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine
    from sonar_cuda.platform import CudaPlatform

    folder = random_head(target_dir, tmp_path / "head")
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(24 + i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def generate(**kwargs) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineArgs(model=str(target_dir), dtype="float32", kv_cache_memory_bytes=64 << 20, **kwargs), platform=CudaPlatform)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))], engine

    expected, _ = generate()
    got, engine = generate(speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3})
    assert got == expected
    assert engine.get_stats().spec_num_drafts > 0
    proposer = engine.core.executor.worker.model_runner.spec.proposer
    assert proposer.draft_pass.captured, "the head's drafting pass was captured"


def test_the_head_keeps_every_position_through_steps_without_drafts(target_dir, tmp_path):
    """Steps without drafts (more requests than ``disable_by_batch_size``) still take the
    target's states into the head's cache: when drafting resumes, each request's cache holds
    one slot per computed position."""
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    folder = random_head(target_dir, tmp_path / "head")
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    engine = LLMEngine(EngineArgs(model=str(target_dir), kv_cache_memory_bytes=KV_BYTES, max_model_len=128, speculative_config=spec))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 13 + j * 7) % 97 + 200 for j in range(20 + 9 * i)]}, params)
    for _ in range(20):  # three requests: past the limit, no drafts (some held, some handed over)
        engine.step()
    assert engine.get_stats().spec_num_drafts == 0
    engine.abort_request(["2"])
    for _ in range(6):
        engine.step()
    assert engine.get_stats().spec_num_drafts > 0
    runner = engine.core.executor.worker.model_runner
    cache = runner.spec.proposer.cache
    for req_id in ("0", "1"):
        assert cache.committed[req_id] == runner.requests[req_id].num_tokens - 1
