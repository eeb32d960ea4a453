"""The DFlash / DSpark proposer against a tiny real target, without an engine: drafting from the
drafter's own cache, step after step, equals a from-scratch reference written from the
published forward pass (keys and values of ``[context; block]``, non-causal attention, the
target's LM head, the Markov bias left to right); batching requests of different context
lengths changes nothing; the confidence estimates are survival probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from sonar.spec_decode import ProposerInputs, SpeculativeConfig
from sonar.spec_decode.dflash import DFlashProposer, DSparkProposer
from sonar.spec_decode.dflash_checkpoint import save_dflash
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
from sonar.spec_decode.draft_graphs import ReplayCapturer
from sonar.spec_decode.interface import DraftCacheBudget

LAYERS = 4


VOCAB = 2048
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen3 target (config and weights only: no tokenizer needed here)."""
    from sonar_models.testing import load_sonar_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = tmp_path_factory.mktemp("dflash-target") / "qwen3"
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path, load_sonar_model(path)


def make_drafter(target, folder, layout: str, markov: str | None, seed: int = 0):
    """A random drafter for the target (std 0.2, so drafts depend on every weight), saved."""
    path, model = target
    hf = model.config
    config = drafter_config_for(hf, layout, 5, 2, [-1, 1, 2] if layout == "deepspec" else [0, 2], MASK,
                                markov_rank=8 if markov else 0, markov_head_type=markov, confidence_head=markov is not None)  # fmt: skip
    drafter = init_drafter(DFlashDrafter(config), std=0.2, seed=seed)
    if markov:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return save_dflash(drafter, folder, embedding=embed, lm_head=head)


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta, dim):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.cat([positions.float()[:, None] * inv] * 2, dim=-1)[:, None, :]  # [N, 1, D]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * emb.cos() + half * emb.sin()


def reference_drafts(drafter, embed, lm_head, states, tokens, k):
    """From scratch: the block after ``tokens`` over all ``states`` (positions 0..len - 2)."""
    c, w = drafter.config, dict(drafter.state_dict())
    eps, hd, heads, kvh = c.rms_norm_eps, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    ctx = rms(states @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(len(states))
    anchor = len(tokens) - 1
    block_pos = torch.arange(anchor, anchor + c.block_size)
    x = embed(torch.tensor([tokens[-1]] + [c.mask_token_id] * (c.block_size - 1)))
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        both = torch.cat([ctx, h])
        q = rope(rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, hd), w[p + "self_attn.q_norm.weight"], eps), block_pos, c.rope_theta, hd)
        key = rope(rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, kvh, hd), w[p + "self_attn.k_norm.weight"], eps), torch.cat([ctx_pos, block_pos]), c.rope_theta, hd)
        value = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, kvh, hd)
        key, value = key.repeat_interleave(heads // kvh, dim=1), value.repeat_interleave(heads // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, key) / math.sqrt(hd)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value).reshape(len(x), -1)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    hidden = rms(x, w["norm.weight"], eps)[c.first_slot : c.first_slot + k]
    logits = lm_head(hidden)
    drafts, prev, survival = [], tokens[-1], 1.0
    survivals = []
    for j in range(k):
        row = logits[j]
        if drafter.markov_head is not None:  # vanilla: w2 (w1 [prev])
            row = row + w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]
        if drafter.confidence_head is not None:
            features = torch.cat([hidden[j], w["markov_head.markov_w1.weight"][prev]])
            survival *= float(torch.sigmoid(features @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0]))
            survivals.append(survival)
        prev = int(row.argmax())
        drafts.append(prev)
    return drafts, survivals


@pytest.mark.parametrize("method, layout, markov", [("dflash", "zlab", None), ("dspark", "deepspec", "vanilla")])
@torch.inference_mode()
def test_cached_drafting_equals_drafting_from_scratch(target, tmp_path, method, layout, markov):
    _, model = target
    folder = make_drafter(target, tmp_path / "drafter", layout, markov)
    k = 4
    cls = DSparkProposer if method == "dspark" else DFlashProposer
    proposer = cls(SpeculativeConfig(method, k, model=str(folder)), torch.device("cpu"))
    proposer.load_model(model)
    assert model.aux_hidden_states.ordered_ids == list(proposer.drafter_config.aux_layer_ids)
    width = len(proposer.drafter_config.target_layer_ids) * 64
    all_states = torch.randn(40, width, generator=torch.Generator().manual_seed(1))
    tokens = [(i * 17) % 1500 + 5 for i in range(12)]  # a prompt of 11 and the first sampled token
    handed, num_accepted, seen = 0, 1, set()
    for kept in (2, 0, 3, 1):  # a prefill, then verify steps that keep 2, 0, 3 drafts
        count = len(tokens) - 1 - handed
        inputs = ProposerInputs(
            ["r"], [list(tokens)], [num_accepted],
            hidden_states=all_states[handed : handed + count], positions=torch.arange(handed, handed + count), num_hidden_states=[count],
        )  # fmt: skip
        out = proposer.propose(inputs)
        drafts = out.token_ids[0]
        expected, survival = reference_drafts(proposer.drafter, proposer.embed, model.compute_logits, all_states[: len(tokens) - 1], tokens, k)
        assert drafts == expected
        if markov:
            assert out.confidence[0] == pytest.approx(survival, rel=1e-4, abs=1e-6)
            assert all(0 < b <= a <= 1 for a, b in zip([1.0] + out.confidence[0], out.confidence[0]))
        else:
            assert out.confidence is None
        seen.add(tuple(drafts))
        handed += count
        tokens += drafts[:kept] + [(len(tokens) * 29) % 1500 + 5]
        num_accepted = kept + 1
    assert len(seen) > 1  # the drafts follow the context
    assert proposer.cache.lengths["r"] == handed
    proposer.remove_requests({"r"})
    assert "r" not in proposer.cache.lengths


@torch.inference_mode()
def test_a_batch_of_requests_drafts_as_each_alone(target, tmp_path):
    _, model = target
    folder = make_drafter(target, tmp_path / "drafter", "deepspec", "vanilla")
    config = SpeculativeConfig("dspark", 5, model=str(folder))
    width = 3 * 64
    gen = torch.Generator().manual_seed(2)
    seqs = {"a": [(i * 7) % 900 + 11 for i in range(9)], "b": [(i * 5) % 700 + 3 for i in range(23)], "c": [17, 23]}
    states = {r: torch.randn(len(t) - 1, width, generator=gen) for r, t in seqs.items()}

    def inputs(req_ids, stale=()):
        counts = [0 if r in stale else len(seqs[r]) - 1 for r in req_ids]
        return ProposerInputs(
            list(req_ids), [seqs[r] for r in req_ids], [1] * len(req_ids),
            hidden_states=torch.cat([states[r][:n] for r, n in zip(req_ids, counts)]),
            positions=torch.cat([torch.arange(n) for n in counts]), num_hidden_states=counts,
        )  # fmt: skip

    alone = {}
    for r in seqs:
        proposer = DSparkProposer(config, torch.device("cpu"))
        proposer.load_model(model)
        out = proposer.propose(inputs([r]))
        alone[r] = (out.token_ids[0], out.confidence[0])
    proposer = DSparkProposer(config, torch.device("cpu"))
    proposer.load_model(model)
    together = proposer.propose(inputs(["b", "a", "c"]))
    for r, tokens, confidence in zip(together.req_ids, together.token_ids, together.confidence):
        assert tokens == alone[r][0]
        assert confidence == pytest.approx(alone[r][1], abs=1e-5)
    # a request whose latest state did not arrive gets no drafts (and no estimates)
    stale = proposer.propose(inputs(["a", "c"], stale={"c"}))
    assert stale.token_ids[1] == [] and stale.confidence[1] is None and len(stale.token_ids[0]) == 5
    # the block pass at a padded batch size (4 rows for 3) and slot bucket, and the context
    # pass at a padded row count (32 rows for 31), as graphs replay them
    padded = DSparkProposer(config, torch.device("cpu"))
    padded.load_model(model)
    capturer = ReplayCapturer()
    padded.init_cache(DraftCacheBudget(num_target_blocks=8, block_size=16, max_num_seqs=4, max_model_len=64, capturer=capturer))
    assert capturer.num_captured == 3 * 3 + 4 and padded.block_pass.shape_for(3, 22) == (4, 32)
    assert padded.context_pass.sizes == [8, 16, 32, 64] and padded.context_pass.shape_for(31, 0) == (32, 0)
    replayed = padded.propose(inputs(["b", "a", "c"]))
    assert replayed.token_ids == together.token_ids
    for got, expected in zip(replayed.confidence, together.confidence):
        assert got == pytest.approx(expected, abs=1e-5)


def test_method_and_block_are_checked_before_loading(target, tmp_path):
    zlab = make_drafter(target, tmp_path / "zlab", "zlab", None)
    with pytest.raises(ValueError, match='use method "dflash"'):
        DSparkProposer.check_config(SpeculativeConfig("dspark", 3, model=str(zlab)))
    with pytest.raises(ValueError, match="num_speculative_tokens=5 exceeds the 4 drafts a block"):
        DFlashProposer.check_config(SpeculativeConfig("dflash", 5, model=str(zlab)))
    with pytest.raises(ValueError, match='needs "model"'):
        DFlashProposer.check_config(SpeculativeConfig("dflash", 3))


def test_a_drafter_for_another_target_is_refused_naming_the_field(target, tmp_path):
    import json

    _, model = target
    folder = make_drafter(target, tmp_path / "drafter", "deepspec", None)
    raw = json.loads((folder / "config.json").read_text())
    for field, value, message in [
        ("num_target_layers", 8, "num_target_layers 8 differs from the target's 4 layers"),
        ("target_layer_ids", [0, 3], r"read the last layer's output"),
        ("hidden_size", 32, "hidden_size 32 differs from the target's 64"),
    ]:
        (folder / "config.json").write_text(json.dumps({**raw, field: value}))
        proposer = DFlashProposer(SpeculativeConfig("dflash", 3, model=str(folder)), torch.device("cpu"))
        with pytest.raises(ValueError, match=message):
            proposer.load_model(model)
