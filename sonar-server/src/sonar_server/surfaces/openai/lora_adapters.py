"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies), routed only
when the server was started with ``--allow-runtime-lora-updating``; behind the API key like
every route that does work. The adapter is loaded in the engine processes; the handler awaits
them and never blocks the event loop."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from sonar_server.errors import ApiError
from sonar_server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name and its folder (relative to ``--lora-root``)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (``lora_int_id`` is accepted and must match it)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_int_id: int | None = None


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.sonar
    if body.load_inplace:
        raise ApiError(400, "load_inplace is not supported: unload the adapter, then load it again", param="load_inplace")
    adapter = await state.adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.sonar
    adapter = await state.adapters.unload(body.lora_name, body.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' removed successfully.")
