"""Every proposer on every architecture: greedy output with n-gram, draft-model, EAGLE-3, DFlash
and DSpark speculation is token for token the output without it, on tiny random models of
each registered architecture (a sliding-window Mistral and the mixture-of-experts ones
included), a batch of requests of different lengths at once, in float32 on the CPU. The
target drafting for itself has every draft accepted, so whole verify steps are kept."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sonar import LLM, SamplingParams
from sonar.spec_decode.dflash_checkpoint import save_dflash
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
from sonar.spec_decode.eagle3_checkpoint import save_eagle3
from sonar.spec_decode.eagle3_head import Eagle3Head
from sonar.spec_decode.eagle3_trainer import head_config_for
from sonar_models.testing import MOE_ARCHS, TINY_CONFIGS, build_tiny_model

LAYERS = 4  # the drafters read layers 1-3 (EAGLE-3) and -1, 1, 2 (DFlash / DSpark)
KV_BYTES = 2**23
K = 4
#: every tiny architecture, and Mistral with a window shorter than the prompts
ARCHS = [*TINY_CONFIGS, "mistral-sliding"]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 14, 24, 9)]


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat a span of themselves (n-gram drafts find matches), of different lengths."""
    return [[(i * 13 + j * 7) % 97 + 200 for j in range(6 + 3 * i)] * 3 for i in range(len(PARAMS))]


@pytest.fixture(scope="module")
def target(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp("spec-archs") / arch
    if arch == "mistral-sliding":
        return build_tiny_model("mistral", folder, num_hidden_layers=LAYERS, sliding_window=8)
    return build_tiny_model(arch, folder, num_hidden_layers=LAYERS)


def eagle3_head(target_dir, folder) -> str:
    from transformers import AutoConfig

    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(AutoConfig.from_pretrained(target_dir), 512, [1, 2, 3]))
    ids = torch.arange(512) * 3 + 5
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(512))
        head.t2d[ids] = True
    return str(save_eagle3(head, folder))


def block_drafter(target_dir, folder, dspark: bool) -> str:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target_dir)
    config = drafter_config_for(hf, "deepspec", 5, 2, [-1, 1, 2], hf.vocab_size - 1, markov_rank=16 if dspark else 0,
                                markov_head_type="vanilla", confidence_head=dspark)  # fmt: skip
    weights = load_file(str(target_dir / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    drafter = init_drafter(DFlashDrafter(config), std=0.1, seed=0)
    return str(save_dflash(drafter, folder, embedding=embedding, lm_head=weights.get("lm_head.weight", embedding.clone())))


def generate(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("target", ARCHS, indirect=True)
def test_every_proposer_keeps_greedy_output_on_every_architecture(target, tmp_path):
    common = {"kv_cache_memory_bytes": KV_BYTES, "max_model_len": 256, "skip_tokenizer_init": True, "dtype": "float32"}
    expected = generate(LLM(str(target), **common))
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3},
        "ngram-passes": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "verify_passes": 3},
        "draft_model": {"method": "draft_model", "model": str(target), "num_speculative_tokens": K},
        "eagle3": {"method": "eagle3", "model": eagle3_head(target, tmp_path / "eagle3"), "num_speculative_tokens": K},
        "dflash": {"method": "dflash", "model": block_drafter(target, tmp_path / "dflash", False), "num_speculative_tokens": K},
        # fixed-length: the confidence policy (DSpark's default) reads measured times and may verify nothing
        "dspark": {"method": "dspark", "model": block_drafter(target, tmp_path / "dspark", True), "num_speculative_tokens": K, "verification": "fixed"},
    }
    for name, spec in specs.items():
        llm = LLM(str(target), speculative_config=spec, **common)
        assert generate(llm) == expected, name
        if name == "ngram-passes":  # alone, each request runs several verify passes a step
            alone = [llm.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(repetitive_prompts(), PARAMS)]
            assert alone == expected, name
        stats = llm.llm_engine.get_stats()
        assert stats.spec_num_draft_tokens > 0, name  # drafts were verified, not just proposed
        if name == "ngram" and stats.spec_num_draft_tokens >= 10:  # a model whose output copies its prompt (not the tiny Gemma 3)
            assert stats.spec_num_accepted_tokens > 0  # and some kept: the verify steps' rows count
        if name == "draft_model":
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # its own drafts: all kept


def test_the_architectures_cover_the_registered_ones():
    from sonar import registry

    import transformers

    built = {registry.architecture_of(getattr(transformers, config_class)()) for config_class, _ in TINY_CONFIGS.values()}
    # served through its language model's class (tests/test_gemma3_image_text_checkpoint.py loads it)
    registered = set(registry.model_architectures()) - {"Gemma3ForConditionalGeneration"}
    assert registered <= built, registered - built
    assert set(MOE_ARCHS) <= set(ARCHS)
