"""LoRA adapters: many fine-tunes of one base model served from one engine.

An adapter is named per request by a :class:`LoRARequest`; the engine reads its PEFT files
(``adapter_config.json``, ``adapter_model.safetensors``; never a pickle), keeps it in host
memory (``max_cpu_loras``, least recently used dropped) and, while requests use it, in one of
``max_loras`` device slots. Every linear layer it targets adds ``x @ A.T @ B.T * scale`` for
the tokens of that adapter's requests, through the two batched operations of
:mod:`sonar.lora.ops`; a step without adapter requests runs no LoRA work at all.

The interfaces (all need ``enable_lora=True``; errors are :class:`LoRAError`, a
``ValueError``, whose message names the adapter and the bad field):

- ``LLM(model, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=None)``;
  ``LLM.generate(prompts, params, lora_request=LoRARequest | list[LoRARequest | None])``.
- ``LLMEngine.add_lora(LoRARequest) -> bool`` (False: already served),
  ``remove_lora(lora_int_id) -> bool`` (False: not served), ``list_loras() -> set[int]``,
  ``add_request(..., lora_request=None)``.
- ``AsyncLLM`` and ``AsyncMPLLM``: ``async add_lora(LoRARequest) -> None`` (raises
  ``LoRAError`` with the engine's message), ``async remove_lora(lora_int_id) -> None``
  (returns once no engine core serves it: an adapter that running or waiting requests use
  takes no new requests and is dropped when they finish, never breaking them; raises
  ``LoRAError`` where none serves it), ``async list_loras() -> list[LoRARequest]``,
  ``add_request(..., lora_request=None)``, ``generate(..., lora_request=None)``. A request
  naming an adapter not served yet adds it first. With several engine cores (data
  parallel) every call goes to each of them; they are the source of truth, and
  ``SchedulerStats.lora_registry_version`` changes whenever their adapter set does, so an
  API server (of several) knows when to call ``list_loras`` again.
- ``EngineCoreRequest.lora_request``; ``LoRACall`` / ``LoRAReply`` in ``sonar.engine.wire``.
"""

from sonar.lora.errors import LoRAError, LoRAInUseError
from sonar.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRAInUseError", "LoRARequest"]
