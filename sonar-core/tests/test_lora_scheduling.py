"""LoRA in the engine core: the scheduler never runs more than ``max_loras`` adapters at once,
adapters chain their own block hashes, the registry drains an adapter in use, and LoRA calls
cross the process boundary as plain data."""

from __future__ import annotations

import pytest

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request
from sonar.engine.scheduler import Scheduler
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.lora import LoRAError, LoRAInUseError, LoRARequest
from sonar.lora.registry import LoRARegistry
from sonar.sampling_params import SamplingParams

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def _request(request_id: str, lora: LoRARequest | None, prompt: list[int] | None = None, max_tokens: int = 3) -> Request:
    prompt = prompt or [100 + len(request_id) + i for i in range(8)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), [0], max_tokens, lora_request=lora)


def _step(scheduler: Scheduler) -> list[str]:
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    tokens = [7 if scheduler.requests[r].num_pending_tokens else None for r in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(ids, tokens, [None] * len(ids)))
    return ids


def test_running_requests_never_use_more_adapters_than_slots() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 256, 256, max_loras=2), KVCacheManager(64, 4))
    loras = {"a1": A, "b1": B, "c1": C, "base": None, "a2": A, "c2": C}
    for request_id, lora in loras.items():
        scheduler.add_request(_request(request_id, lora))
    first = _step(scheduler)
    assert first == ["a1", "b1", "base", "a2"]  # c's requests wait; those behind them pass
    assert [r.request_id for r in scheduler.waiting] == ["c1", "c2"]  # in their order, at the head
    seen_c = False
    while scheduler.requests:
        ids = _step(scheduler)
        adapters = {loras[r].lora_int_id for r in ids if loras[r] is not None}
        assert len(adapters) <= 2
        seen_c |= C.lora_int_id in adapters
    assert seen_c and not scheduler.num_requests_of_lora and not scheduler.num_running_of_lora


def test_adapters_and_the_base_model_chain_different_block_hashes() -> None:
    kv = KVCacheManager(64, 4)
    prompt = list(range(500, 517))
    hashes = {}
    for name, lora in (("base", None), ("a", A), ("b", B)):
        request = _request(name, lora, prompt)
        kv.get_computed_blocks(request)
        hashes[name] = request.block_hashes
    assert len(hashes["base"]) == 4
    assert not set(hashes["base"]) & set(hashes["a"]) and not set(hashes["a"]) & set(hashes["b"])
    again = _request("a-again", A, prompt)
    kv.get_computed_blocks(again)
    assert again.block_hashes == hashes["a"]  # one adapter's prefix is found again


def test_the_registry_drains_an_adapter_in_use_and_refuses_clashes() -> None:
    loaded, unloaded, in_use = [], [], {1: 2}
    registry = LoRARegistry(True, loaded.append, unloaded.append, lambda i: in_use.get(i, 0))
    assert registry.add(A) and not registry.add(A)
    with pytest.raises(LoRAError, match="lora_int_id 1 already names adapter 'a'"):
        registry.add(LoRARequest("other", 1, "/elsewhere"))
    with pytest.raises(LoRAError, match="an adapter named 'a' is already served"):
        registry.add(LoRARequest("a", 7, "/adapters/a"))
    version = registry.version
    assert registry.remove(1) and registry.listed() == [] and registry.version > version
    with pytest.raises(LoRAInUseError, match="is being removed"):
        registry.check_request(A)
    registry.finish_removals()
    assert unloaded == [] and registry.pop_removed() == []  # its two requests still run
    in_use[1] = 0
    registry.finish_removals()
    assert unloaded == [1] and registry.pop_removed() == [1] and not registry.remove(1)
    with pytest.raises(LoRAError, match="is not served: add it first"):
        registry.check_request(A)  # removed: a late request does not bring it back
    registry.add(B)
    registry.check_request(B)
    with pytest.raises(LoRAError, match="lora_int_id 2 names adapter 'b'"):
        registry.check_request(LoRARequest("b2", 2, "/adapters/b2"))
    assert loaded == [A, B] and registry.listed() == [B]
    with pytest.raises(LoRAError, match="start it with enable_lora=True"):
        LoRARegistry(False, loaded.append, unloaded.append, lambda i: 0).add(C)


def test_lora_calls_cross_the_wire_as_plain_data() -> None:
    from sonar.engine import wire

    call = wire.decode_lora_call(wire.encode_lora_call(wire.LoRACall(3, "add", A)))
    assert call.lora_request == A and call.method == "add"
    reply = wire.decode_lora_reply(wire.encode_lora_reply(wire.LoRAReply(0, 3, loras=[A, B], error_type="LoRAError", error="bad")))
    assert reply.loras == [A, B] and reply.error == "bad"
    request = wire.EngineCoreRequest("r", [1, 2], SamplingParams(), 4, 0.0, lora_request=B)
    assert wire.decode_request(wire.encode_request(request)).lora_request == B
    bad = [
        wire.encode_lora_call(wire.LoRACall(1, "list"))[:1] + [b"\x94\x01\xa4exec\xc0\x00"],  # an unknown method
        [wire.LORA, wire._ENCODER.encode([1, "add", ["a", 0, "/x"], 0])],  # lora_int_id 0
        [wire.LORA, wire._ENCODER.encode([1, "add", None, 0])],  # an add without its adapter
    ]
    for frames in bad:
        with pytest.raises(wire.BadFrame):
            wire.decode_lora_call(frames)


def test_a_refused_request_reads_back_as_its_error() -> None:
    """An engine core's refusal (finish_reason abort, a stop_reason naming why) becomes the
    error the frontend raises: LoRAInUseError for an adapter being removed, ValueError else."""
    from sonar.engine import wire
    from sonar.lora import LoRAInUseError

    in_use = wire.rejection(f"{wire.REJECTED_ADAPTER_IN_USE}adapter 'qv' is being removed")
    assert isinstance(in_use, LoRAInUseError) and str(in_use) == "adapter 'qv' is being removed"
    other = wire.rejection(f"{wire.REJECTED}prompt token ids out of range")
    assert type(other) is ValueError and "out of range" in str(other)
    assert wire.rejection("stop") is None and wire.rejection(7) is None and wire.rejection(None) is None
