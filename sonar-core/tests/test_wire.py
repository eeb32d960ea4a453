"""The engine-core wire: typed msgpack messages, token arrays as their own frames, and an
engine-core process that drops what does not decode (random bytes, pickles) and serves on."""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from pathlib import Path

import msgspec
import pytest
import zmq

from sonar.engine import wire
from sonar.engine.scheduler_output import RequestLogprobs
from sonar.sampling_params import SamplingParams
from sonar.structured_output.params import GuidedDecodingParams


def _as_bytes(frames):
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("length", [3, wire.ARRAY_FRAME_MIN_TOKENS, 5000])
def test_requests_round_trip_with_long_prompts_in_their_own_frame(length: int) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, stop=["x"], logit_bias={3: -1.5}, seed=9, guided_decoding=GuidedDecodingParams(regex="[ab]+"))
    request = wire.EngineCoreRequest("r-1", list(range(length)), params, 17, 123.5, 1)
    frames = wire.encode_request(request)
    assert len(frames) == (3 if length >= wire.ARRAY_FRAME_MIN_TOKENS else 2)
    decoded = wire.decode_request(_as_bytes(frames))
    assert decoded.prompt_token_ids == list(range(length))
    assert decoded.sampling_params == params and decoded.max_tokens == 17 and decoded.client_index == 1


def test_outputs_are_deltas_and_keep_non_finite_logprobs() -> None:
    logprobs = RequestLogprobs([[5, 6]], [[-0.25, float("-inf")]], [1])
    message = wire.EngineCoreOutputs(1, [wire.EngineCoreOutput("a", [5], logprobs, finish_reason="length")], wire.SchedulerStats(num_running=3))
    decoded = wire.decode_outputs(_as_bytes(wire.encode_outputs(message)))
    assert decoded.outputs[0].new_token_ids == [5] and decoded.outputs[0].new_logprobs.logprobs[0][1] == float("-inf")
    assert decoded.stats.num_running == 3 and decoded.outputs[0].finish_reason == "length"


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /nonexistent-sonar-marker",))


def _garbage(rng: random.Random) -> list[list[bytes]]:
    valid = wire.encode_request(wire.EngineCoreRequest("ok", [1, 2], SamplingParams(), 4, 0.0))
    cases = [[bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))] for _ in range(40)]
    cases += [[kind, pickle.dumps(_Exploit())] for kind in (wire.ADD, wire.ABORT, wire.OUTPUTS)]
    cases += [[wire.ADD, bytes(valid[1])[:-3]], [wire.ADD, bytes(valid[1]) + b"\x00"], [wire.ADD]]
    bad_params = msgspec.msgpack.decode(bytes(valid[1]))
    bad_params[0], bad_params[2]["temperature"] = "bad-params", -1
    cases.append([wire.ADD, msgspec.msgpack.encode(bad_params)])
    bad_type = msgspec.msgpack.decode(bytes(valid[1]))
    bad_type[0], bad_type[2]["skip_special_tokens"] = "bad-type", {"a": 1}
    cases.append([wire.ADD, msgspec.msgpack.encode(bad_type)])
    ext = msgspec.msgpack.decode(bytes(valid[1]))
    ext[1] = msgspec.msgpack.Ext(wire.ARRAY_EXT, (7).to_bytes(4, "little"))
    cases.append([wire.ADD, msgspec.msgpack.encode(ext)])
    cases.append([wire.ADD, msgspec.msgpack.encode(ext[:1] + [msgspec.msgpack.Ext(wire.ARRAY_EXT, (2).to_bytes(4, "little"))] + ext[2:]), b"abc"])
    return cases


def test_decoders_reject_garbage_and_pickles() -> None:
    for frames in _garbage(random.Random(0)):
        kind = frames[0][:1]
        decode = {wire.ADD: wire.decode_request, wire.ABORT: wire.decode_abort, wire.OUTPUTS: wire.decode_outputs}.get(kind, wire.decode_outputs)
        with pytest.raises(wire.BadFrame):
            if len(frames) < 2:
                raise wire.BadFrame("too few frames")
            decode(frames)


def test_engine_core_process_drops_garbage_and_serves_on(tmp_path: Path) -> None:
    from sonar.config import EngineArgs
    from sonar.engine.core_client import EngineProcesses
    from sonar.engine.core_process import engine_identity
    from sonar.engine.resolve import resolve_engine_config
    from sonar.platform import current_platform
    from sonar_models.testing import build_tiny_model

    model = tmp_path / "tiny"
    build_tiny_model("llama", model)
    platform = current_platform()
    config, _ = resolve_engine_config(EngineArgs(str(model), kv_cache_memory_bytes=8 << 20, max_model_len=256), platform)
    ipc = Path(tempfile.mkdtemp(prefix="sonar-test-ipc-"))
    addresses = wire.ClientAddresses(f"ipc://{ipc}/in", f"ipc://{ipc}/out")
    context = zmq.Context()
    router, pull = context.socket(zmq.ROUTER), context.socket(zmq.PULL)
    router.bind(addresses.input)
    pull.bind(addresses.output)
    engines = EngineProcesses(config, [addresses], platform.replica_env)
    try:
        assert router.poll(120_000), "the engine core said it is ready"
        identity, kind, _ = router.recv_multipart()
        assert identity == engine_identity(0) and kind == wire.READY
        for frames in _garbage(random.Random(1)):
            router.send_multipart([identity, *frames])
        out_of_vocab = wire.EngineCoreRequest("bad-vocab", [10**9], SamplingParams(), 4, 0.0)
        fanned = wire.EngineCoreRequest("bad-n", [1, 2], SamplingParams(n=2), 4, 0.0)
        too_long = wire.EngineCoreRequest("bad-len", [1, 2], SamplingParams(), 10_000, 0.0)
        for bad in (out_of_vocab, fanned, too_long):
            router.send_multipart([identity, *wire.encode_request(bad)])
        request = wire.EngineCoreRequest("real", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 4, 0.0)
        router.send_multipart([identity, *wire.encode_request(request)])
        tokens: list[int] = []
        rejected: list[str] = []
        while len(tokens) < 4:
            assert pull.poll(60_000)
            frames = pull.recv_multipart()
            if frames[0] != wire.OUTPUTS:
                continue
            for output in wire.decode_outputs(frames).outputs:
                if output.req_id == "real":
                    tokens += output.new_token_ids
                elif output.finish_reason == "abort":
                    rejected.append(output.req_id)
        assert len(tokens) == 4 and engines.processes[0].poll() is None
        # what does not decode but names its id, and what decoded but cannot run, each ends at once
        assert [r for r in rejected if r != "ok"] == ["bad-params", "bad-type", "bad-vocab", "bad-n", "bad-len"]
        assert not Path("/nonexistent-sonar-marker").exists()
    finally:
        engines.terminate()
        context.destroy(linger=0)
