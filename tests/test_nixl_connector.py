"""The NixlConnector's worker halves over real NIXL agents: a prefill half serving its KV
caches, a decode half reading blocks from them into its own (host memory; device memory on a
GPU), and the reads it refuses."""

from __future__ import annotations

import time

import pytest
import torch

from sonar.kv_transfer.interface import KVCacheLayout, KVConnectorRole, KVTransferConfig
from sonar.kv_transfer.nixl_connector import NixlConnector, NixlConnectorMetadata, NixlLoad, nixl_module_name

if nixl_module_name() is None:
    pytest.skip("the nixl package is not installed (pip install --no-deps nixl-cu12)", allow_module_level=True)

LAYOUT = KVCacheLayout("tiny:LlamaForCausalLM", "float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=32)
SHAPE = (2, 32, 16, 2, 8)  # [K/V, blocks, block size, heads, head dim]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _caches(device: str, filled: bool) -> list[torch.Tensor]:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    if not filled:
        return [torch.zeros(SHAPE, device=device) for _ in range(LAYOUT.num_layers)]
    return [torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32, device=device).view(SHAPE) + 1e6 * layer for layer in range(LAYOUT.num_layers)]


def _worker(role: str, caches: list[torch.Tensor], engine_id: str) -> NixlConnector:
    config = KVTransferConfig("NixlConnector", role, engine_id=engine_id, kv_connector_extra_config={"kv_transfer_timeout": 2})
    connector = NixlConnector(config, KVConnectorRole.WORKER, LAYOUT)
    connector.register_kv_caches(caches)
    return connector


@pytest.fixture(params=DEVICES)
def pair(request):
    device = request.param
    prefill = _worker("kv_producer", _caches(device, filled=True), "prefill")
    decode = _worker("kv_consumer", _caches(device, filled=False), "decode")
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def _load(prefill: NixlConnector, request_id: str, remote_blocks: list[int], local_blocks: list[int], **changes) -> NixlLoad:
    address = prefill.get_handshake_metadata()
    fields = {
        "request_id": request_id, "remote_engine_id": address["engine_id"], "remote_host": address["host"], "remote_port": address["port"],
        "remote_request_id": request_id, "remote_block_ids": remote_blocks, "block_ids": local_blocks,
    }
    return NixlLoad(**{**fields, **changes})


def _until(connector: NixlConnector, request_ids: set[str], sending: bool, timeout: float = 10.0) -> set[str]:
    """Poll ``get_finished`` until it has reported every one of ``request_ids``; the failed
    loads seen meanwhile."""
    failed: set[str] = set()
    waiting = set(request_ids)
    deadline = time.monotonic() + timeout
    while waiting:
        assert time.monotonic() < deadline, f"{waiting} not reported within {timeout} s"
        done_sending, done_recving = connector.get_finished(set())
        failed |= connector.get_failed_loads()
        waiting -= done_sending if sending else done_recving
        time.sleep(0.005)
    return failed


def test_the_decode_half_reads_the_blocks_and_the_prefill_half_frees_them(pair) -> None:
    prefill, decode = pair
    remote, local = [3, 7, 8], [20, 0, 5]
    prefill.start_load_kv(NixlConnectorMetadata(sends={"req": remote}))
    decode.start_load_kv(NixlConnectorMetadata(loads=[_load(prefill, "req", remote, local)]))
    assert _until(decode, {"req"}, sending=False) == set()
    for theirs, mine in zip(prefill.kv_caches, decode.kv_caches):
        for r, block in zip(remote, local):
            assert torch.equal(mine[:, block].cpu(), theirs[:, r].cpu())  # keys and values
        untouched = [b for b in range(SHAPE[1]) if b not in local]
        assert not mine[:, untouched].any()
    started = time.monotonic()
    _until(prefill, {"req"}, sending=True)
    assert time.monotonic() - started < 1.0  # the read's notification freed them, not the timeout


def test_reads_it_cannot_trust_fail_and_free_the_prefill_blocks(pair, caplog) -> None:
    prefill, decode = pair
    prefill.start_load_kv(NixlConnectorMetadata(sends={"a": [1, 2], "b": [4]}))
    bad = [
        _load(prefill, "a", [1, SHAPE[1]], [0, 1]),  # a block beyond the prefill cache
        _load(prefill, "b", [4], [0], remote_engine_id="restarted"),  # another engine answers there now
    ]
    decode.start_load_kv(NixlConnectorMetadata(loads=bad))
    assert _until(decode, {"a", "b"}, sending=False) == {"a", "b"}
    assert not any(kv.any() for kv in decode.kv_caches)
    started = time.monotonic()
    _until(prefill, {"a"}, sending=True)  # told to free what it could not be read from
    assert time.monotonic() - started < 1.0
    _until(prefill, {"b"}, sending=True, timeout=5.0)  # another engine's: freed after the timeout
    # freed unread, so perhaps reused: a read of them now is refused
    decode.start_load_kv(NixlConnectorMetadata(loads=[_load(prefill, "b", [4], [0])]))
    assert _until(decode, {"b"}, sending=False) == {"b"}
    assert "request 'b''s blocks were freed unread after kv_transfer_timeout (2 s)" in caplog.text
    assert not any(kv.any() for kv in decode.kv_caches)


def test_a_decode_half_of_another_layout_is_refused(pair, caplog) -> None:
    prefill, _ = pair
    other = KVCacheLayout(LAYOUT.model, LAYOUT.dtype, 32, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 16)
    config = KVTransferConfig("NixlConnector", "kv_consumer", engine_id="other")
    decode = NixlConnector(config, KVConnectorRole.WORKER, other)
    decode.register_kv_caches([torch.zeros((2, 16, 32, 2, 8), device=prefill.kv_caches[0].device) for _ in range(2)])
    try:
        prefill.start_load_kv(NixlConnectorMetadata(sends={"c": [1]}))
        decode.start_load_kv(NixlConnectorMetadata(loads=[_load(prefill, "c", [1], [0])]))
        assert _until(decode, {"c"}, sending=False) == {"c"}
        assert "the prefill engine refused: KV layouts differ (prefill vs decode): block_size 16 != 32" in caplog.text
        assert not any(kv.any() for kv in decode.kv_caches)
    finally:
        decode.shutdown()
