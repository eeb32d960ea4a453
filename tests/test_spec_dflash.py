"""DFlash and DSpark with real tiny targets (a Llama-style and a Qwen3-style one): greedy output
with each method is token for token the output without speculation, in mixed batches
(different lengths, sampled and penalised requests), with chunked prefill and preemption; the
method is read from the drafter's folder when none is given; a drafter built for another
target is refused naming the field; ``sonar train-drafter --method dflash|dspark`` saves a
drafter that learned (acceptance above the untrained one's) and serves as a proposer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sonar import LLM, SamplingParams
from sonar.spec_decode.dflash_checkpoint import save_dflash
from sonar.spec_decode.dflash_config import read_dflash_config
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
from sonar.spec_decode.paged_draft_cache import PagedDraftCache

LAYERS = 4
VOCAB = 4096
BLOCK_BYTES = 2 * LAYERS * 16 * 2 * 16 * 4  # one 16-token KV block of the targets below (2 KV heads of 16)


def build_target(arch: str, folder):
    """A tiny random target without a tokenizer (prompts are token ids)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)  # fmt: skip
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from transformers import AutoConfig

    root, built = tmp_path_factory.mktemp("dflash-targets"), {}

    def get(arch: str):
        if arch not in built:
            folder = build_target(arch, root / arch)
            built[arch] = folder, AutoConfig.from_pretrained(folder)
        return built[arch]

    return get


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, targets):
    return targets(request.param)


def random_drafter(target, folder, layout: str, dspark: bool, block: int = 4, seed: int = 0):
    """A random drafter in the published ``layout`` (written with the target's embedding and head)."""
    path, hf = target
    ids = [-1, 1, 2] if layout == "deepspec" else [0, 2]
    config = drafter_config_for(hf, layout, block, 2, ids, VOCAB - 1, markov_rank=16 if dspark else 0,
                                markov_head_type="vanilla", confidence_head=dspark)  # fmt: skip
    drafter = init_drafter(DFlashDrafter(config), std=0.1, seed=seed)
    weights = load_file(str(path / "model.safetensors"))
    return save_dflash(drafter, folder, embedding=weights["model.embed_tokens.weight"], lm_head=weights["lm_head.weight"])


def generate(llm: LLM, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


#: nats between the plain run's top two tokens below which float32 rounding decides greedy:
#: these random targets' distributions are flat, so such ties come up, and a verification pass
#: (a request's tokens in one product) rounds differently from one decode at a time
FLOAT_TIE = 1e-4


def assert_same_greedy(got: list[int], plain: tuple[list[int], list[float]]) -> None:
    """Token for token the plain run's output, up to a step where the plain run's top two
    tokens tie in float32 (the rest is then not compared)."""
    tokens, gaps = plain
    assert len(got) == len(tokens)
    parted = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    if parted is not None:
        assert gaps[parted] < FLOAT_TIE, (parted, got, tokens, gaps[parted])


PROMPTS = [[(i * 13 + j * 7) % 97 + 200 for j in range(20 + 9 * i)] for i in range(4)] + [[301, 302, 303]]


def mixed_params():
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.3)  # decodes without drafts
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)  # sampled
    return params


def plain_runs(target, prompts, params) -> list[tuple[list[int], list[float]]]:
    """Each prompt's output without speculation, with the gap between its top two logprobs at every step."""
    params = [p.clone(logprobs=2) for p in params]
    llm = LLM(str(target[0]), kv_cache_memory_bytes=2**23, max_model_len=128, skip_tokenizer_init=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = []
    for output in outputs:
        steps = output.outputs[0].logprobs
        gaps = [float(top[0] - top[1]) for top in (sorted((e.logprob for e in step.values()), reverse=True) for step in steps)]
        runs.append((output.outputs[0].token_ids, gaps))
    return runs


@pytest.fixture(scope="module")
def plain(target):
    return plain_runs(target, PROMPTS, mixed_params())


@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_greedy_output_with_each_method_equals_no_speculation(target, plain, tmp_path, method, layout):
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": 3}
    # chunked prefill (16-token chunks) and a cache small enough to preempt
    drafter = read_dflash_config(folder)  # the drafter's own paged cache comes out of the same budget
    drafter_bytes = 16 * PagedDraftCache.bytes_per_slot(drafter.num_hidden_layers, drafter.num_key_value_heads, drafter.head_dim, torch.float32)
    llm = LLM(str(target[0]), kv_cache_memory_bytes=10 * (BLOCK_BYTES + drafter_bytes), max_num_batched_tokens=16, max_model_len=128,
              speculative_config=spec, skip_tokenizer_init=True)  # fmt: skip
    got = generate(llm, PROMPTS, mixed_params())
    stats = llm.llm_engine.get_stats()
    for row in (0, 1, 2, 4):
        assert_same_greedy(got[row], plain[row])
    assert len(got[3]) == 12
    assert stats.spec_num_drafts > 0 and stats.num_preemptions > 0
    cache = llm.llm_engine.core.executor.worker.model_runner.spec.proposer.cache  # finished and preempted: every block back
    llm.llm_engine.core.step()  # the worker hears of the last step's finished requests with the next step
    assert cache.num_requests == 0 and cache.num_free_blocks == cache.num_blocks


def test_aborted_requests_give_the_drafter_cache_back(targets, tmp_path):
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    target = targets("qwen3")
    folder = random_drafter(target, tmp_path / "drafter", "zlab", dspark=False)
    spec = {"method": "dflash", "model": str(folder), "num_speculative_tokens": 3}
    engine = LLMEngine(EngineArgs(model=str(target[0]), kv_cache_memory_bytes=2**22, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    cache = engine.core.executor.worker.model_runner.spec.proposer.cache
    for _ in range(4):
        engine.step()
    assert cache.num_requests == 3 and cache.num_free_blocks < cache.num_blocks
    engine.abort_request(["0", "2"])
    engine.step()
    assert cache.num_requests == 1 and cache.row_of("0") == cache.padding_row
    # a proposal for a request dropped while its step was in flight drafts nothing (its cache stays gone)
    runner = engine.core.executor.worker.model_runner
    live = runner.requests["1"]
    sequence = (list(PROMPTS[0]), [5, 6], live.sampling)
    assert runner.spec.propose(["0"], [sequence], [1]) == ({}, {}) and cache.row_of("0") == cache.padding_row
    with pytest.raises(RuntimeError, match="needs the target's hidden states"):  # a live one reaches the drafter
        runner.spec.propose(["1"], [sequence], [1])
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.step()  # the worker hears of the last step's finished requests with the next step
    assert cache.num_requests == 0 and cache.num_free_blocks == cache.num_blocks


def test_the_method_is_read_from_the_drafter_and_a_foreign_drafter_is_refused(targets, tmp_path):
    target = targets("llama")
    folder = random_drafter(target, tmp_path / "dflash", "deepspec", dspark=False, block=3)
    kwargs = dict(kv_cache_memory_bytes=2**23, max_model_len=128, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    expected = generate(LLM(str(target[0]), **kwargs), PROMPTS[:2], params)
    llm = LLM(str(target[0]), **kwargs, speculative_config={"model": str(folder)})
    assert llm.llm_engine.config.speculative_config.method == "dflash"
    assert generate(llm, PROMPTS[:2], params) == expected
    assert llm.llm_engine.get_stats().spec_num_drafts > 0
    bad = tmp_path / "bad-vocab"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), "vocab_size": VOCAB + 8}))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ValueError, match="vocab_size 4104 differs from the target's 4096"):
        LLM(str(target[0]), **kwargs, speculative_config={"method": "dflash", "model": str(bad)})
    with pytest.raises(ValueError, match="exceeds the 3 drafts a block"):
        LLM(str(target[0]), **kwargs, speculative_config={"model": str(folder), "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    from sonar_models.testing import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("dflash-train") / "llama4", num_hidden_layers=LAYERS)


TRAIN_PROMPTS = [{"prompt": p} for p in ("Write a haiku about the sea.", "What is 12 times 7?", "Name three colours.", "Explain rain to a child.")]


def test_train_drafter_learns_and_the_saved_drafter_serves(chat_target, tmp_path, capsys):
    from sonar.cli.main import main
    from sonar.spec_decode import eagle3_data as data
    from sonar.spec_decode.dflash_checkpoint import load_dflash

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in TRAIN_PROMPTS) + "\n")
    out = tmp_path / "drafter"
    code = main([
        "train-drafter", str(chat_target), "--method", "dspark", "--prompts", str(prompts), "--num-prompts", "4",
        "--max-tokens", "16", "--epochs", "6", "--lr", "3e-3", "--batch-size", "4", "--draft-block-size", "4", "--num-draft-layers", "1",
        "--target-layer-ids=-1,1,2", "--markov-rank", "16", "--num-anchors", "16", "--held-out", "0.25", "--output", str(out),
        "--device", "cpu", "--kv-cache-memory-bytes", str(2**22),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    losses = [float(x) for x in next(x for x in printed.splitlines() if x.startswith("train loss by epoch")).split(": ")[1].split(", ")]
    assert losses[-1] < 0.8 * losses[0]
    assert "held-out mean acceptance length at k=4" in printed and "prefix survival by draft position, predicted/observed" in printed
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_rank"] == 16 and raw["enable_confidence_head"]
    assert raw["target_layer_ids"] == [-1, 1, 2] and raw["block_size"] == 4 and raw["num_target_layers"] == LAYERS
    # an untrained drafter of the same shape, for comparison
    untrained = tmp_path / "untrained"
    tensors = load_file(str(out / "model.safetensors"))
    save_dflash(init_drafter(DFlashDrafter(load_dflash(out).config)), untrained, embedding=tensors["embed_tokens.weight"], lm_head=tensors["lm_head.weight"])
    # served on the prompts it learned from (method read from the folder): greedy output unchanged, drafts accepted
    llm = LLM(str(chat_target), kv_cache_memory_bytes=2**22)
    chats = [data.chat_prompt_ids(llm.get_tokenizer(), p["prompt"]) for p in TRAIN_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = generate(llm, chats, params)
    del llm
    accepted = {}
    for name, folder in (("trained", out), ("untrained", untrained)):
        # every draft verified: confidence-scheduled verification (DSpark's default) would cut
        # an unconfident drafter's drafts on the CPU's cost curve, and the comparison is of drafters
        spec_config = {"model": str(folder), "num_speculative_tokens": 3, "verification": "fixed"}
        spec = LLM(str(chat_target), kv_cache_memory_bytes=2**22, speculative_config=spec_config)
        assert generate(spec, chats, params) == expected
        stats = spec.llm_engine.get_stats()
        accepted[name] = stats.spec_num_accepted_tokens / max(1, stats.spec_num_drafts)
        del spec
    assert accepted["trained"] > accepted["untrained"]  # accepted drafts per verify step: about 0.12 against 0


@pytest.mark.cuda
@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_cuda_greedy_with_each_method_equals_without(targets, tmp_path, method, layout):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine
    from sonar_cuda.platform import CudaPlatform

    target = targets("qwen3")
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(24 + i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def run(**kwargs) -> tuple[list[list[int]], LLMEngine]:
        args = EngineArgs(model=str(target[0]), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256, skip_tokenizer_init=True, **kwargs)
        engine = LLMEngine(args, platform=CudaPlatform)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))], engine

    expected, _ = run()
    got, engine = run(speculative_config={"method": method, "model": str(folder), "num_speculative_tokens": 3})
    assert got == expected
    assert engine.get_stats().spec_num_drafts > 0
    proposer = engine.core.executor.worker.model_runner.spec.proposer
    assert proposer.block_pass.captured, "the drafter's block pass was captured"
    # the worker hears of finished requests with the next step: after one more request, none
    # of the first ones holds a row of the drafter's cache
    engine.add_request("after", {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert proposer.cache.num_requests <= 1
    assert all(proposer.cache.row_of(str(i)) == proposer.cache.padding_row for i in range(len(prompts)))


@pytest.mark.parametrize("method, layout", [("dflash", "zlab"), ("dspark", "deepspec")])
def test_the_drafter_keeps_every_position_through_steps_without_drafts(targets, tmp_path, method, layout):
    """Steps that carry no drafts (here: more requests than ``disable_by_batch_size``, and a
    request short of its ``min_tokens``) still hand the target's states to the drafter, so
    when drafting resumes its cache holds every computed position of each request, in order,
    with no holes."""
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine

    target = targets("llama")
    folder = random_drafter(target, tmp_path / "drafter", layout, dspark=method == "dspark")
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": 3, "verification": "fixed", "disable_by_batch_size": 2}
    engine = LLMEngine(EngineArgs(model=str(target[0]), kv_cache_memory_bytes=2**22, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params if i != 1 else params.clone(min_tokens=12))
    for _ in range(20):  # three requests: past the limit, no drafts (some held, some handed over)
        engine.step()
    assert engine.get_stats().spec_num_drafts == 0
    engine.abort_request(["2"])
    for _ in range(6):  # two: drafting again
        engine.step()
    assert engine.get_stats().spec_num_drafts > 0
    runner = engine.core.executor.worker.model_runner
    cache = runner.spec.proposer.cache
    for req_id in ("0", "1"):
        computed = runner.requests[req_id].num_tokens - 1  # every position but the last sampled token's
        slots = cache._host_slots(req_id, 0, cache.committed[req_id])
        positions = cache.positions[torch.as_tensor(slots)].tolist()
        assert positions == list(range(computed)), (req_id, positions)


def test_the_first_drafting_step_of_a_large_batch_drafts_for_a_few(targets, tmp_path):
    """Confidence-scheduled verification learns survival and drafting time on PROBE_ROWS
    requests of a larger batch (a whole batch's drafting costs far more than a plain step);
    the others' states still reach the drafter, and greedy output is unchanged."""
    from sonar.spec_decode.verification import PROBE_ROWS

    target = targets("llama")
    folder = random_drafter(target, tmp_path / "drafter", "deepspec", dspark=True)
    spec = {"method": "dspark", "model": str(folder), "num_speculative_tokens": 3, "verification": "confidence"}
    prompts = [[(i * 13 + j * 7) % 97 + 200 for j in range(12 + i)] for i in range(PROBE_ROWS + 4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = plain_runs(target, prompts, [params] * len(prompts))
    llm = LLM(str(target[0]), kv_cache_memory_bytes=2**23, max_model_len=128, skip_tokenizer_init=True, speculative_config=spec)
    decoder = llm.llm_engine.core.executor.worker.model_runner.spec
    calls = []
    after_step = decoder.after_step

    def recorded(output, req_ids, states, hidden, drafting, draft_limit, chained=None):
        after_step(output, req_ids, states, hidden, drafting, draft_limit, chained)
        if drafting:
            calls.append((len(req_ids), draft_limit, output.draft_rows))

    decoder.after_step = recorded
    got = generate(llm, prompts, params)
    assert calls and calls[0] == (len(prompts), PROBE_ROWS, PROBE_ROWS)
    for tokens, plain in zip(got, expected):
        assert_same_greedy(tokens, plain)
