"""KoboldAI generate bodies, as KoboldCpp accepts them and SillyTavern sends them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

from sonar_server.list_limits import Items

# a client's name for its generation (KoboldCpp's are "KCPP" and a few hex digits); kept while
# it runs and sent to the other API servers, so its length is bounded
Genkey = Annotated[str, StringConstraints(max_length=256)]


class GenerateRequest(BaseModel):
    """``POST /api/v1/generate`` and ``/api/extra/generate/stream``. Kobold's sampler names
    are mapped onto the engine's; any ``SamplingParams`` field may be sent by its own name."""

    model_config = ConfigDict(extra="allow")

    prompt: str
    memory: str | None = None  # KoboldCpp's: put before the prompt and kept when the prompt is cut to fit
    max_length: int | None = None
    max_context_length: int | None = None  # the context the prompt is cut to fit (at most the server's)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    rep_pen: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    sampler_seed: int | None = None
    stop_sequence: Items[str] | None = None
    ban_eos_token: bool = False
    bypass_eos: bool = False
    trim_stop: bool = True
    genkey: Genkey | None = None
    grammar: str | None = None  # a GBNF grammar the output must follow
    model: str | None = None  # Sonar's: a LoRA adapter's name (or the served model's); KoboldCpp has no per-request model


class GenkeyRequest(BaseModel):
    """``/api/extra/generate/check`` and ``/api/extra/abort``."""

    model_config = ConfigDict(extra="allow")

    genkey: Genkey | None = None


class TokenCountRequest(BaseModel):
    """``POST /api/extra/tokencount``."""

    model_config = ConfigDict(extra="allow")

    prompt: str
