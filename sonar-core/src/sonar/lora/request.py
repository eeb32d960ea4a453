"""How a request names the adapter it runs with."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One LoRA adapter, as a request names it (vLLM's fields).

    ``lora_name`` is what clients call it (the ``model`` field of an HTTP request);
    ``lora_int_id`` (>= 1) identifies it inside the engine: slots, the prefix cache and the
    scheduler key on it, so two adapters never share an id; ``lora_path`` is the folder holding
    its PEFT files (``adapter_config.json``, ``adapter_model.safetensors``); ``base_model_name``
    names the model it was trained on, as vLLM's field does.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the served model it adapts (vLLM's field; informational)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
