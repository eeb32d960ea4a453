"""Every message that crosses the engine-core process boundary, and how it is framed.

Messages are msgspec structs encoded as msgpack; nothing is ever pickled. A message travels as
ZeroMQ frames: one byte naming its type, the encoded struct, then any large token-id arrays as
their own frames (sent without copying, referenced from the struct by an ``Ext`` holding the
frame's index). A receiver decodes with typed decoders: a frame that does not decode into the
expected type is rejected whole.

Requests carry token ids, sampling parameters and ids only; outputs carry only what a step
added (deltas), never a request's whole history.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

import msgspec

from sonar.config import EngineConfig
from sonar.engine.scheduler_output import RequestLogprobs
from sonar.lora.request import LoRARequest
from sonar.sampling_params import SamplingParams

# frame 0 of every message: what the rest is
ADD = b"\x00"  # client -> engine: EngineCoreRequest
ABORT = b"\x01"  # client -> engine: AbortRequests
SHUTDOWN = b"\x02"  # client -> engine: nothing more; the engine exits
LORA = b"\x03"  # client -> engine: LoRACall (add, remove or list adapters)
READY = b"\x10"  # engine -> client: EngineReady, once per client
OUTPUTS = b"\x11"  # engine -> client: EngineCoreOutputs (also sent as a heartbeat)
FAILED = b"\x12"  # engine -> client: EngineFailed, right before the engine exits on an error
LORA_REPLY = b"\x13"  # engine -> client: LoRAReply, to the client that made the call

ARRAY_EXT = 1  # Ext code of a token-id array sent as its own frame
ARRAY_FRAME_MIN_TOKENS = 256  # shorter arrays stay inline


class EngineCoreRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sequence for the engine core to generate (n > 1 is fanned out before this)."""

    request_id: str
    prompt_token_ids: list[int] | msgspec.msgpack.Ext
    sampling_params: SamplingParams
    max_tokens: int  # resolved against the context
    arrival_time: float
    client_index: int = 0  # which API server's socket its outputs go to
    priority: int = 0  # with the priority policy: lower runs first
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)


# stop_reason prefixes of a request an engine core refused (finish_reason "abort", no tokens)
REJECTED = "rejected: "
MAX_REQUEST_ID_CHARS = 512  # an id read from a message that did not decode is believed up to this length
REJECTED_ADAPTER_IN_USE = "rejected (adapter being removed): "


def rejection(stop_reason: object) -> ValueError | None:
    """The error a frontend raises for a request its engine core refused (None: not refused)."""
    from sonar.lora.errors import LoRAInUseError

    if not isinstance(stop_reason, str):
        return None
    if stop_reason.startswith(REJECTED_ADAPTER_IN_USE):
        return LoRAInUseError(stop_reason[len(REJECTED_ADAPTER_IN_USE):])
    if stop_reason.startswith(REJECTED):
        return ValueError(stop_reason[len(REJECTED):])
    return None


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


LORA_METHODS = ("add", "remove", "list")


class LoRACall(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A frontend's call on an engine core's adapters; answered by a ``LoRAReply`` with the
    same ``call_id`` (a removal once the adapter's last request has finished)."""

    call_id: int
    method: str  # one of LORA_METHODS
    lora_request: LoRARequest | None = None  # add
    lora_int_id: int = 0  # remove

    def __post_init__(self) -> None:
        if self.method not in LORA_METHODS:
            raise ValueError(f"unknown LoRA call {self.method!r}")
        if self.method == "add" and self.lora_request is None:
            raise ValueError("a LoRA add names its adapter")


class LoRAReply(msgspec.Struct, array_like=True):
    """An engine core's answer to a ``LoRACall``: ``changed`` (an adapter was added or
    removed), the adapters served (a list call), or the error (its class name and message)."""

    engine_index: int
    call_id: int
    changed: bool = False
    loras: list[LoRARequest] = msgspec.field(default_factory=list)
    error_type: str | None = None  # "LoRAError" or "LoRAInUseError"
    error: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step added to one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: RequestLogprobs | None = None
    prompt_logprobs: RequestLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, once the request finished


class SchedulerStats(msgspec.Struct, array_like=True):
    """An engine core's load and counters, as of its latest step."""

    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0  # steps launched
    # KV connectors: prompt tokens looked up / found outside (host offload, a prefill engine),
    # and asynchronous loads that failed (their tokens were computed instead)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_kv_load_failures: int = 0
    # speculative decoding, since the engine started: verify steps with drafts, draft tokens
    # verified, drafts accepted, and accepted drafts by position (0: a step's first draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # draft tokens the proposer produced (proposed - verified: what the scheduler cut), and
    # draft tokens verified by position
    spec_num_proposed_tokens: int = 0
    spec_verified_per_position: list[int] = msgspec.field(default_factory=list)
    # LoRA: changes whenever the engine core's served adapters change (summed over engine
    # cores by a frontend: it changes when any of theirs does); read list_loras again then
    lora_registry_version: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One step's outputs for one client, with the engine's load; an empty ``outputs`` list is
    a heartbeat. ``step_elapsed_s`` is how long the step now running has run (0: idle)."""

    engine_index: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    step_elapsed_s: float = 0.0


class EngineReady(msgspec.Struct, array_like=True):
    engine_index: int
    pid: int
    num_blocks: int
    block_size: int


class EngineFailed(msgspec.Struct, array_like=True):
    engine_index: int
    error: str


_REQUEST_DECODER = msgspec.msgpack.Decoder(EngineCoreRequest)
_ABORT_DECODER = msgspec.msgpack.Decoder(AbortRequests)
_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
_READY_DECODER = msgspec.msgpack.Decoder(EngineReady)
_FAILED_DECODER = msgspec.msgpack.Decoder(EngineFailed)
_LORA_CALL_DECODER = msgspec.msgpack.Decoder(LoRACall)
_LORA_REPLY_DECODER = msgspec.msgpack.Decoder(LoRAReply)
_ENCODER = msgspec.msgpack.Encoder()


class BadFrame(ValueError):
    """A message that does not decode into the type its first frame names."""


def encode_request(request: EngineCoreRequest) -> list[Any]:
    """Frames of an add message; a long prompt travels as its own frame, uncopied."""
    frames: list[Any] = [ADD, b""]
    ids = request.prompt_token_ids
    if isinstance(ids, list) and len(ids) >= ARRAY_FRAME_MIN_TOKENS:
        frames.append(array("i", ids))  # int32, native order: both ends are one host
        request = msgspec.structs.replace(request, prompt_token_ids=msgspec.msgpack.Ext(ARRAY_EXT, struct.pack("<I", 2)))
    frames[1] = _ENCODER.encode(request)
    return frames


def decode_request(frames: list[Any]) -> EngineCoreRequest:
    if len(frames) < 2:
        raise BadFrame(f"bad request: {len(frames)} frames")
    try:
        request = _REQUEST_DECODER.decode(frames[1])
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise BadFrame(f"bad request: {exc}") from None
    ids = request.prompt_token_ids
    if isinstance(ids, msgspec.msgpack.Ext):
        if ids.code != ARRAY_EXT or len(ids.data) != 4:
            raise BadFrame("bad request: unknown extension in prompt_token_ids")
        (index,) = struct.unpack("<I", ids.data)
        if not 2 <= index < len(frames):
            raise BadFrame("bad request: prompt_token_ids names a frame that was not sent")
        buffer = memoryview(frames[index])
        if buffer.nbytes % 4:
            raise BadFrame("bad request: a token-id frame is not a whole number of int32 values")
        values = array("i")
        values.frombytes(buffer)
        request.prompt_token_ids = values.tolist()
    return request


def encode_abort(request_ids: list[str]) -> list[Any]:
    return [ABORT, _ENCODER.encode(AbortRequests(request_ids))]


def request_id_of(frames: list[Any]) -> str | None:
    """The request id of an add message that does not decode as a whole (its first field, read
    with no schema), so the sender can be told; None where even that cannot be read."""
    if len(frames) < 2:
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1])
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str) and 0 < len(fields[0]) <= MAX_REQUEST_ID_CHARS:
        return fields[0]
    return None


def decode_abort(frames: list[Any]) -> AbortRequests:
    return _decode(_ABORT_DECODER, frames, "abort")


def encode_outputs(outputs: EngineCoreOutputs) -> list[Any]:
    return [OUTPUTS, _ENCODER.encode(outputs)]


def decode_outputs(frames: list[Any]) -> EngineCoreOutputs:
    return _decode(_OUTPUTS_DECODER, frames, "outputs")


def encode_ready(ready: EngineReady) -> list[Any]:
    return [READY, _ENCODER.encode(ready)]


def decode_ready(frames: list[Any]) -> EngineReady:
    return _decode(_READY_DECODER, frames, "ready")


def encode_failed(failed: EngineFailed) -> list[Any]:
    return [FAILED, _ENCODER.encode(failed)]


def decode_failed(frames: list[Any]) -> EngineFailed:
    return _decode(_FAILED_DECODER, frames, "failed")


def encode_lora_call(call: LoRACall) -> list[Any]:
    return [LORA, _ENCODER.encode(call)]


def decode_lora_call(frames: list[Any]) -> LoRACall:
    return _decode(_LORA_CALL_DECODER, frames, "LoRA call")


def encode_lora_reply(reply: LoRAReply) -> list[Any]:
    return [LORA_REPLY, _ENCODER.encode(reply)]


def decode_lora_reply(frames: list[Any]) -> LoRAReply:
    return _decode(_LORA_REPLY_DECODER, frames, "LoRA reply")


def _decode(decoder: msgspec.msgpack.Decoder, frames: list[Any], what: str) -> Any:
    if len(frames) != 2:
        raise BadFrame(f"bad {what} message: {len(frames)} frames, expected 2")
    try:
        return decoder.decode(frames[1])
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise BadFrame(f"bad {what} message: {exc}") from None


class ClientAddresses(msgspec.Struct, array_like=True):
    """The two sockets one frontend binds: requests go out of ``input``, outputs come into
    ``output``."""

    input: str
    output: str


class EngineCoreLaunch(msgspec.Struct):
    """What an engine-core process reads from its stdin (as JSON) when it starts."""

    config: EngineConfig
    engine_index: int
    clients: list[ClientAddresses]
    log_level: str = "WARNING"


def encode_launch(launch: EngineCoreLaunch) -> bytes:
    return msgspec.json.encode(launch)


def decode_launch(data: bytes) -> EngineCoreLaunch:
    return msgspec.json.decode(data, type=EngineCoreLaunch)
