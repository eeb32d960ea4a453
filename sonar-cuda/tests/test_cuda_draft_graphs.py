"""Drafter passes replayed from CUDA graphs (marker ``cuda``): the EAGLE-3 drafting pass and
the DSpark block pass, captured by ``CudaGraphCapturer`` at padded batch sizes and slot
buckets, give the drafts of the same pass run eagerly at those shapes and of the pass at its
own shape, step after step (the graphs read the block table and lengths the steps update)."""

from __future__ import annotations

import pytest
import torch

from sonar.spec_decode import ProposerInputs, SpeculativeConfig
from sonar.spec_decode.draft_graphs import ReplayCapturer
from sonar.spec_decode.interface import DraftCacheBudget

pytestmark = pytest.mark.cuda

VOCAB = 2048
SEQS = {"a": [(i * 7) % 900 + 11 for i in range(9)], "b": [(i * 5) % 700 + 3 for i in range(40)], "c": [17, 23]}
BUDGET = dict(num_target_blocks=16, block_size=16, max_num_seqs=4, max_model_len=128)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar_models.testing import load_sonar_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = tmp_path_factory.mktemp("draft-graphs-target") / "qwen3"
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path, load_sonar_model(path).to("cuda")


def dspark_folder(target, folder):
    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter

    _, model = target
    config = drafter_config_for(model.config, "deepspec", 5, 2, [-1, 1, 2], VOCAB - 1, markov_rank=8, markov_head_type="vanilla", confidence_head=True)
    drafter = init_drafter(DFlashDrafter(config), std=0.2, seed=0)
    return save_dflash(drafter, folder, embedding=model.model.embed_tokens.weight.cpu(), lm_head=model.lm_head.weight.cpu())


def eagle3_folder(target, folder):
    from transformers import AutoConfig

    from sonar.spec_decode.eagle3_checkpoint import save_eagle3
    from sonar.spec_decode.eagle3_head import Eagle3Head
    from sonar.spec_decode.eagle3_trainer import head_config_for

    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(AutoConfig.from_pretrained(target[0]), 512, [1, 2, 3]))
    ids = torch.arange(512) * 3 + 5
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(512))
        head.t2d[ids] = True
    return save_eagle3(head, folder)


def steps(width: int):
    """Three propose calls over requests a, b, c: their prompts, then two steps of 2 and 1
    verified tokens each (the target's states are random: the drafts need not be good)."""
    gen = torch.Generator().manual_seed(2)
    seqs = {r: list(t) for r, t in SEQS.items()}
    handed = {r: 0 for r in seqs}
    for step in range(3):
        req_ids = ["b", "a", "c"]
        counts = [len(seqs[r]) - 1 - handed[r] for r in req_ids]
        yield ProposerInputs(
            req_ids, [list(seqs[r]) for r in req_ids], [1] * 3,
            hidden_states=torch.randn(sum(counts), width, generator=gen).cuda(),
            positions=torch.cat([torch.arange(handed[r], handed[r] + n) for r, n in zip(req_ids, counts)]).cuda(),
            num_hidden_states=counts,
        )  # fmt: skip
        for r, n in zip(req_ids, counts):
            handed[r] += n
            seqs[r] += [(len(seqs[r]) * 29 + k) % 1500 + 5 for k in range(2 - step % 2)]


def run(cls, config, model, capturer, width):
    proposer = cls(config, torch.device("cuda"))
    proposer.load_model(model)
    proposer.init_cache(DraftCacheBudget(**BUDGET, capturer=capturer))
    return [(out.token_ids, out.confidence) for out in map(proposer.propose, steps(width))], proposer


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
@torch.inference_mode()
def test_replayed_drafter_pass_equals_the_eager_pass(target, tmp_path, method):
    from sonar.spec_decode.dflash import DSparkProposer
    from sonar.spec_decode.eagle3 import Eagle3Proposer
    from sonar_cuda.draft_graphs import CudaGraphCapturer

    _, model = target
    folder = eagle3_folder(target, tmp_path / "head") if method == "eagle3" else dspark_folder(target, tmp_path / "drafter")
    cls = Eagle3Proposer if method == "eagle3" else DSparkProposer
    config = SpeculativeConfig(method, 4, model=str(folder))
    width = 3 * 64
    eager, _ = run(cls, config, model, None, width)
    padded, _ = run(cls, config, model, ReplayCapturer(), width)
    capturer = CudaGraphCapturer()
    replayed, proposer = run(cls, config, model, capturer, width)
    assert capturer.graphs, "no pass was captured"
    passes = proposer.draft_pass if method == "eagle3" else proposer.block_pass
    assert passes.shape_for(3, 64) == (4, 64)  # 3 requests ride the graph of 4
    for (got, got_conf), (same_shape, same_conf), (own_shape, _) in zip(replayed, padded, eager):
        assert got == same_shape  # the graph replays the padded pass
        assert got == own_shape  # which drafts as the pass at its own shape
        if method == "dspark":
            for row, expected in zip(got_conf, same_conf):
                assert row == pytest.approx(expected, abs=1e-6)
    assert proposer.cache.committed == {"a": 8 + 3, "b": 39 + 3, "c": 1 + 3}
