"""``sonar train-drafter`` on a tiny target: the saved head is in the EAGLE-3 layout and
serves as an eagle3 drafter; training lowers the loss on the target's own answers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sonar import LLM, SamplingParams
from sonar.cli.main import main
from sonar.spec_decode import eagle3_data as data
from sonar.spec_decode.eagle3_checkpoint import load_eagle3
from sonar.spec_decode.eagle3_head import Eagle3Head
from sonar.spec_decode.eagle3_trainer import TrainOptions, evaluate_head, head_config_for, train_head

PROMPTS = [
    {"turns": ["Write a haiku about the sea.", "Now one about the mountains."]},
    {"prompt": "What is 12 times 7?"},
    {"text": "Name three colours."},
    {"turns": ["Explain rain to a child."]},
    {"prompt": "Give me a word that rhymes with cat."},
    {"text": "Say hello in French."},
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from sonar_models.testing import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("drafter-target") / "llama4", num_hidden_layers=4)


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def test_train_drafter_saves_a_head_that_loads_and_drafts(target_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "head"
    code = main([
        "train-drafter", str(target_dir), "--prompts", str(prompts_file), "--num-prompts", "6", "--max-tokens", "12",
        "--epochs", "1", "--batch-size", "2", "--draft-vocab-size", "128", "--output", str(out), "--device", "cpu",
        "--kv-cache-memory-bytes", str(2**22),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "train loss by epoch:" in printed and "held-out top-1 agreement by draft position:" in printed
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (128, 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128) and "embed_tokens.weight" not in tensors
    assert int(tensors["t2d"].sum()) == 128
    target_ids = torch.arange(128) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], target_ids)  # d2t and t2d name the same tokens
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 128
    head, _ = load_eagle3(out)
    assert head.config.num_aux_layers == 3
    # it serves as the eagle3 drafter, and greedy output is unchanged
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 900 + 100 for i in range(10 + j)]} for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(target_dir), kv_cache_memory_bytes=2**22).generate(prompts, params)]
    spec = LLM(str(target_dir), kv_cache_memory_bytes=2**22, speculative_config={"method": "eagle3", "model": str(out)})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    assert spec.llm_engine.get_stats().spec_num_drafts > 0


def test_bad_prompt_files_are_refused_with_the_line_number(target_dir, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"answer": "no prompt here"}\n')
    assert main(["train-drafter", str(target_dir), "--prompts", str(path), "--output", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:2: needs a text field" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["0", "-1e-3", "nan"])
def test_a_learning_rate_that_is_not_positive_is_refused(target_dir, tmp_path, capsys, lr):
    assert main(["train-drafter", str(target_dir), "--method", "dspark", f"--lr={lr}", "--output", str(tmp_path / "o")]) == 2
    assert "--lr must be > 0" in capsys.readouterr().err


def test_each_method_has_its_default_learning_rate():
    from sonar.cli.train_drafter import DEFAULT_LR, METHODS

    assert set(DEFAULT_LR) == set(METHODS) and DEFAULT_LR["eagle3"] == 5e-4 and DEFAULT_LR["dflash"] == DEFAULT_LR["dspark"] == 1e-3


def test_training_lowers_the_loss_and_raises_agreement_on_the_targets_answers(target_dir):
    llm = LLM(str(target_dir), kv_cache_memory_bytes=2**22)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [data.chat_prompt_ids(tokenizer, text) for text in map(data.prompt_text, PROMPTS)]
    responses = data.generate_responses(llm, prompt_ids, 16, 0.0, use_tqdm=False)
    runner = data.model_runner_of(llm)
    full = [p + r for p, r in zip(prompt_ids, responses)]
    samples = [data.Sample(t, len(p), a, f) for t, p, (a, f) in zip(full, prompt_ids, data.target_states(runner, full, [1, 2, 3]))]
    target_ids, d2t, t2d = data.draft_vocabulary(samples, 49152, 256)
    rows = data.target_head_rows(runner.model, target_ids, 64)
    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(runner.model_config.hf_config, 256, [1, 2, 3]))
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    embed = torch.nn.Embedding.from_pretrained(runner.model.model.embed_tokens.weight.detach().clone())
    options = TrainOptions(epochs=8, lr=3e-3, batch_size=3, ttt_steps=2, progress=False)
    before = evaluate_head(head, samples, embed, rows, options)
    result = train_head(head, samples, embed, rows, options)
    after = evaluate_head(head, samples, embed, rows, options)
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert after.loss < 0.95 * before.loss
    assert after.top1[0] > before.top1[0]


def test_extra_sampled_answers_train_and_held_out_prompts_keep_one(target_dir, prompts_file, tmp_path, capsys):
    # 6 prompts, one held out: 1 + 5 first answers, then 2 sampled answers of each of the 5
    code = main([
        "train-drafter", str(target_dir), "--method", "dflash", "--prompts", str(prompts_file), "--num-prompts", "6",
        "--max-tokens", "12", "--epochs", "1", "--batch-size", "4", "--draft-block-size", "3", "--num-draft-layers", "1",
        "--num-anchors", "8", "--held-out", "0.1", "--samples-per-prompt", "3", "--sample-temperature", "1.0",
        "--output", str(tmp_path / "d"), "--device", "cpu", "--kv-cache-memory-bytes", str(2**22),
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "the target answers them 2 more time(s) (temperature 1)" in captured.err
    assert "on 15 answers" in captured.err and "1 held out" in captured.err


def test_saved_answers_train_another_drafter_on_the_same_data(target_dir, prompts_file, tmp_path, capsys):
    """One run writes the target's answers; a second drafter (another method) trains on
    exactly them, the same ones held out, without generating any."""
    answers = tmp_path / "answers.json"
    common = ["--max-tokens", "12", "--epochs", "1", "--batch-size", "2", "--device", "cpu", "--kv-cache-memory-bytes", str(2**22)]
    code = main([
        "train-drafter", str(target_dir), "--method", "dflash", "--prompts", str(prompts_file), "--num-prompts", "6",
        "--draft-block-size", "3", "--num-draft-layers", "1", "--num-anchors", "8", "--samples-per-prompt", "2",
        "--sample-temperature", "1.0", "--save-answers", str(answers), "--output", str(tmp_path / "d"), *common,
    ])  # fmt: skip
    first = capsys.readouterr()
    assert code == 0, first.err
    record = json.loads(answers.read_text())
    assert record["format"] == "sonar-drafter-answers" and record["num_held_out"] == 1
    assert len(record["sequences"]) == 11  # 6 first answers and 5 sampled ones
    code = main(["train-drafter", str(target_dir), "--answers", str(answers), "--draft-vocab-size", "128", "--output", str(tmp_path / "e"), *common])
    second = capsys.readouterr()
    assert code == 0, second.err
    assert "11 answers read from" in second.err and "the target answers" not in second.err
    assert "training on 10 answers" in second.err and "1 held out" in second.err
    assert (tmp_path / "e" / "model.safetensors").exists()


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not JSON"),
    (json.dumps({"format": "other"}), "not a drafter answers file"),
    (json.dumps({"format": "sonar-drafter-answers", "version": 1, "num_held_out": 1, "sequences": [[[1], [2, 3]]]}), "num_held_out"),
    (json.dumps({"format": "sonar-drafter-answers", "version": 1, "num_held_out": 1, "sequences": [[[1], [2, 3]], [[1], [5]]]}), "sequence 1"),
    (json.dumps({"format": "sonar-drafter-answers", "version": 1, "num_held_out": 1, "sequences": [[[1], [2, 3]], [[1], [5, 10**9]]]}), "outside the target's vocabulary"),
])
def test_bad_answers_files_are_refused_naming_the_problem(target_dir, tmp_path, capsys, content, message):
    path = tmp_path / "answers.json"
    path.write_text(content)
    code = main(["train-drafter", str(target_dir), "--answers", str(path), "--output", str(tmp_path / "o"), "--kv-cache-memory-bytes", str(2**22)])
    assert code == 2
    assert message in capsys.readouterr().err


def test_extra_answers_sample_with_a_seed_each(target_dir):
    llm = LLM(str(target_dir), kv_cache_memory_bytes=2**22)
    prompts = [[(5 * i + 11) % 900 + 100 for i in range(8)], [(3 * i + 7) % 900 + 100 for i in range(9)]]
    first = data.generate_samples(llm, prompts, 10, 1.0, 3, seed=0, use_tqdm=False)
    assert [len(answers) for answers in first] == [3, 3]
    assert len({tuple(a) for a in first[0]}) > 1  # three draws, not one repeated
    assert data.generate_samples(llm, prompts, 10, 1.0, 3, seed=0, use_tqdm=False) == first  # reproducible


@pytest.mark.parametrize(("flags", "message"), [
    (["--samples-per-prompt", "0"], "--samples-per-prompt must be at least 1"),
    (["--samples-per-prompt", "2", "--sample-temperature", "0"], "--sample-temperature must be > 0"),
])
def test_bad_sampling_flags_are_refused(target_dir, tmp_path, capsys, flags, message):
    assert main(["train-drafter", str(target_dir), *flags, "--output", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
