"""The host offload tier (``kv_offload_bytes``): a long shared prefix evicted from a tiny device
cache comes back from host memory instead of being computed again, with the same greedy output."""

from __future__ import annotations

import random

import msgspec
import pytest

from sonar import LLM, SamplingParams
from sonar.kv_transfer.offload import OffloadMetadata

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny llama: K and V, 2 layers, 16 tokens, 2 heads of 16, float32
DEVICE_BLOCKS = 40  # 640 tokens: the prefix is evicted by the filler request
HOST_BLOCKS = 20

rng = random.Random(7)
PREFIX = [rng.randint(100, 49000) for _ in range(400)]
FILLER = [rng.randint(100, 49000) for _ in range(480)]
PROMPTS = [PREFIX + [11, 12, 13], FILLER, PREFIX + [21, 22]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _run(model: str, **kwargs) -> tuple[LLM, list[list[int]], list[int]]:
    """The three prompts one after another: token ids of each and prompt tokens computed for each."""
    llm = LLM(model, max_model_len=512, kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES, **kwargs)
    outputs, computed = [], []
    for prompt in PROMPTS:
        before = llm.llm_engine.get_stats().num_prompt_tokens
        outputs.append(llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids)
        computed.append(llm.llm_engine.get_stats().num_prompt_tokens - before)
    return llm, outputs, computed


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    _, plain_outputs, plain_computed = _run(model)
    offload = _run(model, kv_offload_bytes=HOST_BLOCKS * BLOCK_BYTES)
    return plain_outputs, plain_computed, offload


def test_an_evicted_prefix_comes_back_from_host_memory(runs) -> None:
    plain_outputs, plain_computed, (llm, outputs, computed) = runs
    assert outputs == plain_outputs  # greedy output unchanged
    stats = llm.llm_engine.get_stats()
    # without the tier the device cache kept only the prefix's last 9 blocks; with it the rest came from host
    assert plain_computed[2] == len(PROMPTS[2]) - 9 * 16
    assert computed[2] == len(PROMPTS[2]) - 400  # only the suffix was computed
    assert stats.external_prefix_cache_hits == 400 - 9 * 16
    assert stats.external_prefix_cache_queries == sum(len(p) for p in PROMPTS)
    assert computed[:2] == plain_computed[:2]  # the first two prompts found nothing anywhere


def test_the_tier_holds_no_more_than_its_budget_and_no_block_leaks(runs) -> None:
    *_, (llm, _, _) = runs
    connector = llm.llm_engine.core.kv_connector
    assert connector.num_host_blocks == HOST_BLOCKS
    assert 0 < connector.num_cached_host_blocks <= HOST_BLOCKS
    worker_half = llm.llm_engine.core.executor.worker.model_runner.kv_connector
    assert sum(t.numel() * t.element_size() for t in worker_half.host) == HOST_BLOCKS * BLOCK_BYTES
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# -- the size: a 6,000-token shared prefix ----------------------------------------------

LONG_BLOCK_BYTES = 2 * 1 * 16 * 2 * 16 * 4  # one layer: K and V, 16 tokens, 2 heads of 16, float32
LONG_DEVICE_BLOCKS = 400  # 6,400 tokens: one long request at a time
LONG_PREFIX = [rng.randint(100, 49000) for _ in range(6000)]
LONG_FILLER = [rng.randint(100, 49000) for _ in range(6000)]
LONG_PROMPTS = [LONG_PREFIX + [11, 12, 13], LONG_FILLER, LONG_PREFIX + [21, 22]]


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    from sonar_models.testing import build_tiny_model

    model = str(build_tiny_model("llama", tmp_path_factory.mktemp("long") / "llama", num_hidden_layers=1, max_position_embeddings=8192))

    def run(**kwargs) -> tuple[LLM, list[list[int]], list[int]]:
        llm = LLM(model, max_model_len=6100, kv_cache_memory_bytes=LONG_DEVICE_BLOCKS * LONG_BLOCK_BYTES, **kwargs)
        outputs, computed = [], []
        for prompt in LONG_PROMPTS:
            before = llm.llm_engine.get_stats().num_prompt_tokens
            outputs.append(llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids)
            computed.append(llm.llm_engine.get_stats().num_prompt_tokens - before)
        return llm, outputs, computed

    _, plain_outputs, plain_computed = run()
    return plain_outputs, plain_computed, run(kv_offload_bytes=LONG_DEVICE_BLOCKS * LONG_BLOCK_BYTES)


def test_a_6000_token_prefix_too_big_for_the_device_comes_back_from_host_memory(long_runs) -> None:
    plain_outputs, plain_computed, (llm, outputs, computed) = long_runs
    assert outputs == plain_outputs  # equal to the output computed again
    # the filler request took 376 of the 400 device blocks: without the tier only the prefix's
    # first 24 blocks were still there and the other 5,616 tokens were computed again
    assert plain_computed[2] == len(LONG_PROMPTS[2]) - 24 * 16
    assert computed[2] == 2  # with it those 5,616 tokens came back from host memory
    assert llm.llm_engine.get_stats().external_prefix_cache_hits == 6000 - 24 * 16


def test_a_budget_below_one_block_is_refused(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="holds no KV block: one block takes 8192 bytes"):
        LLM(str(tiny_model_dir("llama")), max_model_len=512, kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES, kv_offload_bytes=100)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(tiny_model_dir("llama")), kv_offload_bytes=BLOCK_BYTES, enable_prefix_caching=False)


def test_the_step_metadata_is_plain_data() -> None:
    metadata = OffloadMetadata(saves=[(3, 0), (4, 1)], loads=[(1, 7)])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(metadata), type=OffloadMetadata)
    assert decoded == metadata


@pytest.mark.cuda
def test_on_cuda_the_tier_is_pinned_and_output_unchanged(tiny_model_dir) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine
    from sonar_cuda.platform import CudaPlatform

    def run(**kwargs) -> tuple[LLMEngine, list[list[int]]]:
        args = EngineArgs(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=512,
                          kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES, **kwargs)
        engine = LLMEngine(args, platform=CudaPlatform)
        outputs = []
        for i, prompt in enumerate(PROMPTS):  # one after another, as above
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
            while engine.has_unfinished_requests():
                outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        return engine, outputs

    _, expected = run()
    engine, outputs = run(kv_offload_bytes=HOST_BLOCKS * BLOCK_BYTES)
    assert outputs == expected
    assert engine.get_stats().external_prefix_cache_hits == 400 - 9 * 16
    assert all(t.is_pinned() for t in engine.core.executor.worker.model_runner.kv_connector.host)


@pytest.mark.cuda
def test_on_cuda_a_load_into_blocks_still_being_saved_waits_for_each_layer_of_the_save() -> None:
    """One step saves blocks to the host and loads other contents into the same blocks: the
    saves run on the side stream, each layer's load waits for that layer's save, and both
    end with the right bytes (a load that ran early would put its contents on the host)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.kv_transfer.offload import OffloadingConnector

    layers, blocks = 8, 256  # 16 MiB a layer: the copies take long enough for a race to show
    shape = (2, blocks, 16, 8, 128)
    c = OffloadingConnector.__new__(OffloadingConnector)
    c.kv_caches = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in range(layers)]
    c.host = [torch.randn((2 * blocks, *shape[0:1], *shape[2:]), dtype=torch.float16).pin_memory() for _ in range(layers)]
    c._save_stream, c._saves_in_flight, c._save_events = None, {}, []
    c._load_stream, c._load_events = None, []
    before = [kv.cpu() for kv in c.kv_caches]
    incoming = [host[blocks:].clone() for host in c.host]
    saves = [(b, b) for b in range(blocks)]  # device block b -> host slot b
    loads = [(blocks + b, b) for b in range(blocks)]  # host slot blocks + b -> device block b
    c.start_load_kv(OffloadMetadata(saves, loads, list(range(blocks))))
    torch.cuda.synchronize()
    for layer in range(layers):
        assert torch.equal(c.host[layer][:blocks], before[layer].transpose(0, 1))
        assert torch.equal(c.kv_caches[layer].cpu(), incoming[layer].transpose(0, 1))
    assert not c._saves_in_flight  # the step's blocks were handed out: nothing left to wait for


@pytest.mark.cuda
def test_on_cuda_each_layer_reads_its_own_loads_while_later_layers_still_load() -> None:
    """A step's loads run on their own stream: the forward's stream waits, before each layer,
    for that layer's copies alone. What each layer reads right after its wait is what was
    loaded, and the first layer's wait ends before the last layer's copies do."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from sonar.kv_transfer.offload import OffloadingConnector

    layers, blocks = 16, 512  # 32 MiB a layer: the last layer's copies land well after the first's
    shape = (2, blocks, 16, 8, 128)
    c = OffloadingConnector.__new__(OffloadingConnector)
    c.kv_caches = [torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(layers)]
    c.host = [torch.randn((blocks, *shape[0:1], *shape[2:]), dtype=torch.float16).pin_memory() for _ in range(layers)]
    c._save_stream, c._saves_in_flight, c._save_events = None, {}, []
    c._load_stream, c._load_events = None, []
    metadata = OffloadMetadata([], [(b, b) for b in range(blocks)], [])
    assert c.needs_layer_hooks(metadata) and not c.needs_layer_hooks(OffloadMetadata())
    c.kv_caches[0].float().sum()  # the reads' kernels loaded before the clock matters
    torch.cuda.synchronize()
    c.start_load_kv(metadata)
    all_loaded = torch.cuda.Event(enable_timing=True)
    all_loaded.record(c._load_stream)
    sums, first_read = [], torch.cuda.Event(enable_timing=True)
    for layer in range(layers):  # as the attention layers do, on the forward's stream
        c.wait_for_layer_load(layer)
        sums.append(c.kv_caches[layer].float().sum())
        if layer == 0:
            first_read.record()
    c.wait_for_save()
    torch.cuda.synchronize()
    assert first_read.elapsed_time(all_loaded) > 1.0  # ms: layer 0 was read while later layers still loaded
    for layer in range(layers):
        assert torch.equal(c.kv_caches[layer].cpu(), c.host[layer].transpose(0, 1))
        assert torch.allclose(sums[layer].cpu(), c.host[layer].float().sum(), rtol=1e-4)


def test_the_device_copy_path_moves_the_same_bytes_as_the_plain_one(monkeypatch) -> None:
    """The GPU path (a staging tensor and one host copy per run of slots) run on CPU tensors,
    in small staging chunks, against the plain index copies."""
    import torch

    from sonar.kv_transfer import offload
    from sonar.kv_transfer.offload import OffloadingConnector, slot_runs

    assert slot_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]
    monkeypatch.setattr(offload, "STAGING_BYTES", 3 * 2 * 4 * 2 * 8 * 4)  # three blocks a chunk
    kv_caches = [torch.randn(2, 12, 4, 2, 8) for _ in range(3)]
    pairs = [(7, 0), (2, 1), (9, 2), (3, 3), (0, 6), (11, 7), (5, 4), (1, 9)]

    def connector() -> OffloadingConnector:
        c = OffloadingConnector.__new__(OffloadingConnector)
        c.kv_caches = [kv.clone() for kv in kv_caches]
        c.host = [torch.zeros(10, 2, 4, 2, 8) for _ in kv_caches]
        return c

    plain, staged = connector(), connector()
    plain._copy(pairs, to_host=True)
    staged._copy_device(pairs, to_host=True)
    for a, b in zip(plain.host, staged.host):
        assert torch.equal(a, b)
    back = [(b, s) for b, s in zip([4, 6, 8, 10, 0, 1, 2, 3], [s for _, s in pairs])]
    plain._copy(back, to_host=False)
    staged._copy_device(back, to_host=False)
    for a, b in zip(plain.kv_caches, staged.kv_caches):
        assert torch.equal(a, b)
    assert not torch.equal(plain.kv_caches[0], kv_caches[0])  # the loads did write


def test_a_finished_requests_blocks_are_copied_early_and_handed_out_without_a_copy(tiny_model_dir) -> None:
    """With room on the host a request's full blocks are copied when it finishes (an engine
    core steps once more for that when nothing else runs, as the serving loop does here); a
    later eviction of them copies nothing."""
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=512, kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK_BYTES,
              kv_offload_bytes=80 * BLOCK_BYTES)
    connector = llm.llm_engine.core.kv_connector
    first = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)[0].outputs[0].token_ids
    core = llm.llm_engine.core
    assert core.has_unfinished_requests()  # no request, but copies to hand to the worker
    while core.has_unfinished_requests():
        core.step()
    assert connector.num_cached_host_blocks == len(PROMPTS[0]) // 16  # every full prompt block, copied already
    assert len(connector._shadow_of) == 25 and not connector._saves
    llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY)  # hands out 16 of the prefix's blocks
    assert len(connector._slot_of) == 16  # kept for good, from the early copies
    before = llm.llm_engine.get_stats().num_prompt_tokens
    again = llm.generate({"prompt_token_ids": PREFIX + [11, 12, 13]}, GREEDY)[0].outputs[0].token_ids
    assert again == first
    assert llm.llm_engine.get_stats().num_prompt_tokens - before == 3  # the prefix came from host and device
