"""LoRA adapters made by peft on the tiny models: each adapter's greedy output equals the
peft-merged model in transformers, mixed batches equal each request alone, bad adapters are
refused with a clear ``LoRAError``, adapters never share KV, and the engine-core process path
adds, lists, serves and removes adapters."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import HFOracle, random_prompts
from sonar import LLM, SamplingParams
from sonar.lora import LoRAError, LoRAInUseError, LoRARequest

NUM_TOKENS = 10
KV_BYTES = 16 << 20
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (target modules, rank, extra LoraConfig options)
LLAMA_ADAPTERS = {
    "all": (ALL, 8, {}),
    "qv": (["q_proj", "v_proj"], 4, {}),  # two parts of the fused qkv only, rank below the slots'
    "mlp": (["gate_proj", "up_proj", "down_proj"], 16, {"use_rslora": True}),
    "ko": (["k_proj", "o_proj"], 2, {}),
}


def make_adapter(base_path: Path, out: Path, targets: list[str], rank: int, seed: int, safe: bool = True, **options) -> torch.nn.Module:
    """Save a random peft adapter for ``base_path`` in ``out``; returns the merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **options)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough that the adapter visibly changes the output
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(str(out), safe_serialization=safe)
    return model.merge_and_unload().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    oracle = HFOracle.__new__(HFOracle)
    oracle.model = model
    return oracle.greedy(prompt, NUM_TOKENS)[0]


def run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama(tiny_model_dir, tmp_path_factory):
    """The tiny Llama, its four adapters and each one's expected greedy output."""
    path = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-llama")
    prompts = random_prompts(2, seed=11, min_len=5, max_len=40)
    requests, expected = {}, {}
    for index, (name, (targets, rank, options)) in enumerate(LLAMA_ADAPTERS.items()):
        merged = make_adapter(path, root / name, targets, rank, seed=index, **options)
        requests[name] = LoRARequest(name, index + 1, str(root / name))
        expected[name] = [hf_greedy(merged, p) for p in prompts]
    expected[None] = [HFOracle(path).greedy(p, NUM_TOKENS)[0] for p in prompts]
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=4, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    return path, root, prompts, requests, expected, llm


def test_each_adapter_equals_the_peft_merged_model(llama) -> None:
    _, _, prompts, requests, expected, llm = llama
    for name, request in requests.items():
        assert run(llm, prompts, [request] * len(prompts)) == expected[name], name
        assert expected[name] != expected[None], f"adapter {name} changes nothing: the test would prove nothing"
    assert run(llm, prompts, [None] * len(prompts)) == expected[None]


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_request_alone(llama) -> None:
    _, _, prompts, requests, expected, llm = llama
    names = [*requests, None]
    mixed_prompts = [p for p in prompts for _ in names]
    mixed_loras = [requests[n] if n else None for _ in prompts for n in names]
    mixed = run(llm, mixed_prompts, mixed_loras)
    alone = [run(llm, [p], [lora])[0] for p, lora in zip(mixed_prompts, mixed_loras)]
    assert mixed == alone
    assert mixed == [expected[n][i] for i in range(len(prompts)) for n in names]


def test_more_adapters_than_slots_wait_for_one_and_keep_their_output(llama) -> None:
    path, _, prompts, requests, expected, _ = llama
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    names = list(requests)
    loras = [requests[n] for n in names for _ in prompts]
    assert run(llm, prompts * len(names), loras) == [expected[n][i] for n in names for i in range(len(prompts))]
    manager = llm.llm_engine.core.executor.worker.model_runner.lora
    assert manager.num_activations >= 4 and len(manager.slot_of) <= 2  # slots were taken over, never exceeded
    assert len(manager.host) <= 2  # host LRU bounded; dropped adapters were read again
    assert llm.llm_engine.list_loras() == {1, 2, 3, 4}


def test_qwen3_adapter_equals_the_peft_merged_model(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("qwen3")
    merged = make_adapter(path, tmp_path / "a", ALL, 8, seed=5)
    prompts = random_prompts(2, seed=3, min_len=5, max_len=30)
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    request = LoRARequest("a", 1, str(tmp_path / "a"))
    assert run(llm, prompts, [request, request]) == [hf_greedy(merged, p) for p in prompts]
    assert run(llm, prompts, [None, None]) == [HFOracle(path).greedy(p, NUM_TOKENS)[0] for p in prompts]


def test_phi3_adapter_on_the_fused_modules_equals_the_peft_merged_model(tiny_model_dir, tmp_path) -> None:
    """Phi-3 adapters name the checkpoint's fused qkv_proj and gate_up_proj, which the model splits."""
    path = tiny_model_dir("phi3")
    merged = make_adapter(path, tmp_path / "a", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 8, seed=6)
    prompts = random_prompts(2, seed=4, min_len=5, max_len=30)
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    request = LoRARequest("a", 1, str(tmp_path / "a"))
    assert run(llm, prompts, [request, None]) == [hf_greedy(merged, prompts[0]), HFOracle(path).greedy(prompts[1], NUM_TOKENS)[0]]


def test_adapters_never_share_prefix_cache_blocks(llama) -> None:
    _, _, _, requests, _, llm = llama
    prompt = random_prompts(1, seed=99, min_len=64, max_len=64)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora)[0].num_cached_tokens

    assert cached(requests["all"]) == 0
    assert cached(requests["qv"]) == 0  # same tokens, another adapter: nothing shared
    assert cached(None) == 0  # nor with the base model
    assert cached(requests["all"]) >= 48  # its own blocks are found again
    assert cached(None) >= 48


@pytest.mark.parametrize(
    "case, message",
    [
        ("rank", "r=32 is above max_lora_rank=16"),
        ("shapes", "an adapter for another base model?"),
        ("pickle", "holds only adapter_model.bin, a pickle"),
        ("unknown_target", "target_modules ['rotary_proj'] are not linear layers"),
        ("dora", "DoRA (use_dora) is not supported"),
        ("modules_to_save", "modules_to_save"),
        ("lm_head", "LoRA on lm_head is not supported"),
        ("embedding", "LoRA on embeddings is not supported"),
        ("missing", "lora_path is not a folder"),
    ],
)
def test_bad_adapters_are_refused_naming_the_problem(llama, tiny_model_dir, tmp_path, case: str, message: str) -> None:
    path, _, prompts, requests, expected, llm = llama
    folder = tmp_path / case
    if case == "rank":
        make_adapter(path, folder, ["q_proj"], 32, seed=0)
    elif case == "shapes":  # qwen3's q_proj has 128 outputs, llama's 64
        make_adapter(tiny_model_dir("qwen3"), folder, ["q_proj"], 4, seed=0)
    elif case == "pickle":
        make_adapter(path, folder, ["q_proj"], 4, seed=0, safe=False)
    elif case == "unknown_target":
        make_adapter(path, folder, ["q_proj"], 4, seed=0)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "rotary_proj"]
        (folder / "adapter_config.json").write_text(json.dumps(config))
    elif case == "dora":
        make_adapter(path, folder, ["q_proj"], 4, seed=0, use_dora=True)
    elif case == "modules_to_save":
        make_adapter(path, folder, ["q_proj"], 4, seed=0, modules_to_save=["lm_head"])
    elif case == "lm_head":
        make_adapter(path, folder, ["q_proj", "lm_head"], 4, seed=0)
    elif case == "embedding":
        make_adapter(path, folder, ["embed_tokens"], 4, seed=0)
    request = LoRARequest(case, 50, str(folder))
    with pytest.raises(LoRAError, match=re.escape(message)):
        llm.llm_engine.add_lora(request)
    with pytest.raises(LoRAError):  # through generate too: nothing is queued
        run(llm, prompts[:1], [request])
    assert 50 not in llm.llm_engine.list_loras()
    assert run(llm, prompts[:1], [requests["qv"]]) == expected["qv"][:1]  # the engine serves on


def test_lora_needs_enable_lora_and_the_cli_flags_set_it(tiny_model_dir) -> None:
    import argparse

    from sonar.cli.engine_args import add_engine_arguments, engine_args_from

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(LoRAError, match="start it with enable_lora=True"):
        run(llm, [[300, 301]], [LoRARequest("a", 1, "/nowhere")])
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from(parser.parse_args(["m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"]))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 3, 32, 5)
    defaults = engine_args_from(parser.parse_args(["m"]))
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank, defaults.max_cpu_loras) == (False, 1, 16, None)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        type(args)(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_removing_an_adapter_in_use_waits_for_its_requests(llama) -> None:
    """In process: a removed adapter takes no new requests, its running ones finish intact."""
    _, _, prompts, requests, expected, llm = llama
    engine = llm.llm_engine
    engine.add_lora(requests["ko"])
    engine.add_request("in-use", {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), lora_request=requests["ko"])
    engine.step()
    assert engine.remove_lora(4) is True
    assert 4 not in engine.list_loras() and engine.lora_removal_pending(4)
    with pytest.raises(LoRAError, match="is being removed"):
        engine.add_lora(requests["ko"])
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
    assert tokens == expected["ko"][0]
    assert not engine.lora_removal_pending(4)
    assert engine.remove_lora(4) is False
    assert engine.add_lora(requests["ko"]) is True  # back again once removed


def test_an_engine_core_process_adds_lists_serves_and_removes_adapters(llama) -> None:
    """AsyncMPLLM against a real engine-core process: the calls cross the sockets as
    LoRACall / LoRAReply, errors come back as LoRAError with the engine's message."""
    import tempfile

    from sonar.config import EngineArgs
    from sonar.engine.async_mp import AsyncMPLLM
    from sonar.engine.core_client import EngineProcesses, client_addresses
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform

    path, root, prompts, requests, expected, _ = llama
    platform = current_platform()
    config, tokenizer = resolve_engine_config(
        EngineArgs(str(path), dtype="float32", enable_lora=True, max_loras=2, max_model_len=256, kv_cache_memory_bytes=KV_BYTES), platform
    )
    addresses = client_addresses(tempfile.mkdtemp(prefix="sonar-test-ipc-"), 0)
    engines = EngineProcesses(config, [addresses], platform.replica_env)
    client = None
    try:
        client = AsyncMPLLM(config, tokenizer, addresses, check_started=engines.check_started)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

        async def generate(request_id: str, prompt: list[int], lora: LoRARequest | None) -> list[int]:
            final = None
            async for output in client.generate(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora):
                final = output
            return final.outputs[0].token_ids

        async def scenario() -> None:
            version = client.get_stats().lora_registry_version
            await client.add_lora(requests["all"])
            await client.add_lora(requests["all"])  # again: a no-op
            assert await client.list_loras() == [requests["all"]]
            got = await asyncio.gather(
                generate("a", prompts[0], requests["all"]), generate("b", prompts[1], None), generate("c", prompts[0], requests["qv"])
            )
            assert got == [expected["all"][0], expected[None][1], expected["qv"][0]]
            assert [r.lora_int_id for r in await client.list_loras()] == [1, 2]  # "qv" was added by its request
            with pytest.raises(LoRAError, match="r=32 is above max_lora_rank=16"):
                make_adapter(path, root / "big", ["q_proj"], 32, seed=0)
                await client.add_lora(LoRARequest("big", 9, str(root / "big")))
            # removing an adapter in use returns once its request has finished, intact; on a
            # loaded machine the 80 tokens may all arrive as one output before the removal is
            # seen waiting, so that case is tried again (the adapter added back)
            long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
            for attempt in range(5):
                stream = await client.add_request(f"d{attempt}", {"prompt_token_ids": prompts[1]}, long, lora_request=requests["qv"])
                final = await stream.__anext__()
                removal = asyncio.ensure_future(client.remove_lora(2))
                num_while_running = 0
                refused = None
                async for final in stream:
                    if not final.finished:
                        assert not removal.done()
                        num_while_running += 1
                        if refused is None:  # a new request for the adapter being removed: an error, not an empty answer
                            with pytest.raises(LoRAInUseError) as refused:
                                await generate(f"e{attempt}", prompts[0], requests["qv"])
                await removal
                if num_while_running:
                    break
                await client.add_lora(requests["qv"])
            assert num_while_running > 0 and refused is not None
            tokens = final.outputs[0].token_ids
            assert len(tokens) == 80 and tokens[:NUM_TOKENS] == expected["qv"][1]
            assert await client.list_loras() == [requests["all"]]
            with pytest.raises(LoRAError, match="no LoRA adapter with lora_int_id 2"):
                await client.remove_lora(2)
            await asyncio.sleep(0.6)  # a heartbeat carries the new registry version
            assert client.get_stats().lora_registry_version > version

        asyncio.run(scenario())
    finally:
        if client is not None:
            client.client.shutdown_engines()
            client.shutdown()
        engines.terminate()


def test_adapters_add_onto_a_quantized_base_layer(llama) -> None:
    """FP8 base weights (quantized at load): each linear layer's output is the quantized
    product plus exactly the adapter's ``x @ A.T @ B.T * alpha / r``, read from its file."""
    from safetensors.torch import load_file

    from sonar.lora.manager import LoRAManager
    from sonar_models.testing import load_sonar_model

    path, root, _, requests, _, _ = llama
    model = load_sonar_model(path, quantization="fp8")
    manager = LoRAManager(model, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_tokens=64, dtype=torch.float32, device=torch.device("cpu"))
    manager.add(requests["qv"])
    tensors = load_file(str(root / "qv" / "adapter_model.safetensors"))
    scale = 2 * 4 / 4  # lora_alpha / r
    x = torch.randn(5, model.config.hidden_size)
    manager.prepare_step([0, requests["qv"].lora_int_id], [2, 3])  # 2 base tokens, then 3 adapter tokens
    layer = model.model.layers[1].self_attn.qkv_proj
    assert type(layer.linear_method).__name__ != "UnquantizedLinearMethod"
    with torch.inference_mode():
        got = layer(x)
        base = layer.linear_method.apply(layer, x)
    expected = base.clone()
    for part in ("q", "v"):
        prefix = f"base_model.model.model.layers.1.self_attn.{part}_proj"
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        expected[2:, layer.part_rows(part)] += x[2:] @ a.T @ b.T * scale
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[2:], base[2:]) and torch.equal(got[:2], base[:2])
    manager.prepare_step([0, 0], [2, 3])  # no adapter in the step: the base output, untouched
    with torch.inference_mode():
        assert torch.equal(layer(x), base)


def test_the_in_process_async_frontend_adds_serves_and_removes_adapters(llama) -> None:
    from sonar.config import EngineArgs
    from sonar.engine.async_client import AsyncLLM

    path, _, prompts, requests, expected, _ = llama
    client = AsyncLLM.from_engine_args(
        EngineArgs(str(path), dtype="float32", enable_lora=True, max_loras=2, max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

    async def generate(request_id: str, lora: LoRARequest | None) -> list[int]:
        final = None
        async for output in client.generate(request_id, {"prompt_token_ids": prompts[0]}, params, lora_request=lora):
            final = output
        return final.outputs[0].token_ids

    async def scenario() -> None:
        await client.add_lora(requests["mlp"])
        assert await client.list_loras() == [requests["mlp"]]
        got = await asyncio.gather(generate("a", requests["mlp"]), generate("b", requests["all"]), generate("c", None))
        assert got == [expected["mlp"][0], expected["all"][0], expected[None][0]]
        running = asyncio.ensure_future(generate("d", requests["all"]))
        await asyncio.sleep(0)
        await client.remove_lora(requests["all"].lora_int_id)  # waits for "d" where it still runs
        assert await running == expected["all"][0]
        assert await client.list_loras() == [requests["mlp"]]
        with pytest.raises(LoRAError, match="no LoRA adapter with lora_int_id 1"):
            await client.remove_lora(requests["all"].lora_int_id)
        with pytest.raises(LoRAError, match="lora_path is not a folder"):
            await client.add_lora(LoRARequest("gone", 9, "/nowhere"))

    try:
        asyncio.run(scenario())
    finally:
        client.shutdown()


def test_a_platform_shrink_started_before_the_base_product_keeps_the_output(llama, monkeypatch) -> None:
    """The ``lora_shrink_begin`` seam: where a platform registers it, each adapter layer starts
    its shrink before the base product and joins it at the add (on the GPU, a side stream
    beside the product); the greedy output stays the peft-merged model's."""
    from sonar import ops
    from sonar.lora import ops as lora_ops
    from sonar_models import layers

    _, _, prompts, requests, expected, llm = llama
    order: list[str] = []
    apply = layers.Linear.forward

    def begin(x, a, token_slots):
        order.append("begin")
        y = lora_ops.torch_lora_shrink(x, a, token_slots)

        def join():
            order.append("join")
            return y

        return join

    def forward(self, x):
        if self.lora is not None:
            order.append("layer")
        return apply(self, x)

    monkeypatch.setattr(layers.Linear, "forward", forward)
    monkeypatch.setitem(ops._OVERRIDES, "cpu", {**ops._OVERRIDES.get("cpu", {}), "lora_shrink_begin": begin})  # the CPU platform's others kept
    assert run(llm, prompts, [requests["all"]] * len(prompts)) == expected["all"]
    assert order.count("begin") == order.count("join") > 0
    assert order[:3] == ["layer", "begin", "join"]  # started in the layer, joined before the next one


def test_chat_runs_its_lora_request_and_takes_vllm_arguments(llama) -> None:
    """``LLM.chat`` as vLLM takes it: ``lora_request`` runs the adapter (as ``generate``),
    ``chat_template_kwargs`` reach the template, content given as text parts is joined."""
    _, _, _, requests, _, llm = llama
    lora = next(iter(requests.values()))
    params = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "user", "content": "hi"}]
    base = llm.chat(messages, params)[0]
    prompt = base.prompt_token_ids
    assert llm.chat(messages, params, lora_request=lora)[0].outputs[0].token_ids != base.outputs[0].token_ids  # the adapter shows
    assert llm.chat(messages, params, lora_request=lora)[0].outputs[0].token_ids == run(llm, [prompt], [lora])[0][:6]  # greedy: a prefix of the longer run
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert llm.chat(parts, params)[0].prompt_token_ids == prompt
    template = "{% if flag is defined %}FLAG {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rendered = llm.chat(messages, params, chat_template=template, chat_template_kwargs={"flag": True})[0].prompt_token_ids
    assert llm.get_tokenizer().decode(rendered) == "FLAG hi"
    with pytest.raises(ValueError, match="content parts of type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_several_verify_passes_a_step_keep_each_adapters_output(llama) -> None:
    """n-gram speculation with ``verify_passes``: a lone request with an adapter runs its
    passes through the adapter's slots and decodes as the merged model does."""
    path, _, prompts, requests, expected, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "verify_passes": 3}
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_model_len=256, kv_cache_memory_bytes=KV_BYTES, speculative_config=spec)
    for name in (None, *list(requests)[:2]):
        lora = requests.get(name) if name else None
        for prompt, want in zip(prompts, expected[name]):
            assert run(llm, [prompt], [lora]) == [want], name
    assert llm.llm_engine.get_stats().spec_num_drafts > 0
