"""The offline ``LLM`` takes a vLLM user's arguments: those whose effect Sonar has anyway are
accepted (others of the same name refused with the values that would be accepted),
``enforce_eager`` reaches the engine, and ``max_logprobs`` above 20 allows that many."""

from __future__ import annotations

import pytest
import torch

from sonar import LLM, SamplingParams

KV_BYTES = 1 << 24


def test_vllm_arguments_that_change_nothing_are_accepted(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, swap_space=4, disable_log_stats=True,
              enable_chunked_prefill=True, tokenizer_mode="auto", cpu_offload_gb=0, compilation_config=3, max_seq_len_to_capture=8192)  # fmt: skip
    assert llm.llm_engine.config.enforce_eager
    for name, value in (("tokenizer_mode", "slow"), ("cpu_offload_gb", 4)):
        with pytest.raises(ValueError, match=f"{name}="):
            LLM(path, **{name: value})


def test_max_logprobs_above_20_allows_that_many(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=KV_BYTES, max_logprobs=30)
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, logprobs=25, temperature=0))[0].outputs[0]
    assert all(len(entry) >= 25 for entry in output.logprobs)
    with pytest.raises(ValueError, match="exceeds max_logprobs=30"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, logprobs=31))


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory_bytes=KV_BYTES)
    prompt = list(range(5, 105))  # longer than the context
    params = SamplingParams(max_tokens=4, temperature=0)
    cut = llm.generate({"prompt_token_ids": prompt}, params.clone(truncate_prompt_tokens=20))[0]
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": prompt[-20:]}, params)[0].outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": prompt[:30]}, params.clone(truncate_prompt_tokens=-1))[0]  # -1: the context's length
    assert short.prompt_token_ids == prompt[:30]
    for bad in (0, -2, "5"):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_reset_prefix_cache_computes_prompts_again(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory_bytes=KV_BYTES)
    prompt = {"prompt_token_ids": list(range(5, 70))}
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate(prompt, params)
    assert llm.generate(prompt, params)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0


def test_override_generation_config_lays_fields_over_the_models(tiny_model_dir, tmp_path) -> None:
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 9}))
    llm = LLM(str(folder), max_model_len=128, kv_cache_memory_bytes=KV_BYTES, override_generation_config={"temperature": 0.0, "top_k": 4})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.0, 0.8, 4, 9)
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 9 or output.finish_reason == "stop"
    assert output.token_ids == llm.generate({"prompt_token_ids": [5, 6, 7]}, defaults)[0].outputs[0].token_ids  # greedy: the same tokens
    # over "vllm" (no model defaults) too, as in vLLM
    plain = LLM(str(folder), max_model_len=128, kv_cache_memory_bytes=KV_BYTES, generation_config="vllm", override_generation_config={"max_new_tokens": 3})
    assert (plain.get_default_sampling_params().temperature, plain.get_default_sampling_params().max_tokens) == (1.0, 3)
    for bad, message in (({"do_sample": True}, "'do_sample' is not a sampling field"), ({"top_p": "high"}, "top_p must be a number")):
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), override_generation_config=bad)


@pytest.mark.parametrize(
    "rope_override, rope_parameters",
    [
        ({"rope_parameters": {"rope_theta": 50.0}}, {"rope_theta": 50.0}),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),  # the older field name
    ],
)
def test_hf_overrides_reach_the_model_as_transformers_reads_them(tiny_model_dir, rope_override: dict, rope_parameters: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import HFOracle

    path = str(tiny_model_dir("llama"))
    overrides = {**rope_override, "max_position_embeddings": 96}
    llm = LLM(path, hf_overrides=overrides, kv_cache_memory_bytes=KV_BYTES, dtype="float32")
    # derived from the overridden config; a linear scaling stretches it by its factor, as in vLLM
    assert llm.llm_engine.config.max_model_len == 96 * rope_parameters.get("factor", 1)
    oracle = HFOracle(path)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = {**config.rope_parameters, **rope_parameters}
    oracle.model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    prompt = list(range(40, 80))
    want, rows = oracle.greedy(prompt, 8)
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert output.token_ids == want
    got = torch.tensor([entry[token].logprob for entry, token in zip(output.logprobs, want)])
    assert torch.allclose(got, torch.stack([row[t] for row, t in zip(rows, want)]), atol=1e-3)
    plain = HFOracle(path).greedy(prompt, 8)[1]  # the override changed the model's numbers
    assert max(float((a - b).abs().max()) for a, b in zip(rows, plain)) > 1e-2
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(path, hf_overrides=["rope_theta"])


def test_yarn_stretches_the_context_and_decodes_like_transformers(tiny_model_dir) -> None:
    """As long-context serving is set up from vLLM: a YaRN scaling laid over the config, and a
    max_model_len past max_position_embeddings (the pretraining length times the factor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import HFOracle

    path = str(tiny_model_dir("llama"))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    overrides = {"rope_scaling": yarn, "max_position_embeddings": 64}
    llm = LLM(path, hf_overrides=overrides, max_model_len=256, kv_cache_memory_bytes=KV_BYTES, dtype="float32")
    assert llm.llm_engine.config.max_model_len == 256
    oracle = HFOracle(path)
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = 64
    config.rope_parameters = {**config.rope_parameters, **yarn}
    oracle.model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    prompt = list(range(100, 190))  # 90 positions: past the 64 the model was "pretrained" on
    want, rows = oracle.greedy(prompt, 8)
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert output.token_ids == want
    got = torch.tensor([entry[token].logprob for entry, token in zip(output.logprobs, want)])
    assert torch.allclose(got, torch.stack([row[t] for row, t in zip(rows, want)]), atol=1e-3)
    with pytest.raises(ValueError, match="max_model_len=257 exceeds the model's context of 256 tokens"):
        LLM(path, hf_overrides=overrides, max_model_len=257, kv_cache_memory_bytes=KV_BYTES)


def test_without_chunked_prefill_prompts_prefill_whole_with_the_same_tokens(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + n))} for i, n in enumerate((100, 7, 60, 3))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chunked = LLM(path, max_model_len=128, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=32)
    whole = LLM(path, max_model_len=128, kv_cache_memory_bytes=KV_BYTES, enable_chunked_prefill=False)
    assert whole.llm_engine.config.max_num_batched_tokens >= 128 and not whole.llm_engine.config.enable_chunked_prefill
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, params)] == [o.outputs[0].token_ids for o in chunked.generate(prompts, params)]
    with pytest.raises(ValueError, match="with chunked prefill off, max_num_batched_tokens=32 must be at least max_model_len=128"):
        LLM(path, max_model_len=128, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_hf_overrides_that_do_not_fit_the_weights_or_the_config_are_refused(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    for overrides, message in (
        ({"num_hidden_layers": 3}, "the checkpoint did not provide"),
        ({"hidden_size": 96}, "does config.json match the weights"),
        ({"max_position_embeddings": "long"}, "hf_overrides max_position_embeddings='long' does not fit the model's config"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(path, hf_overrides=overrides, max_model_len=64, kv_cache_memory_bytes=KV_BYTES)
