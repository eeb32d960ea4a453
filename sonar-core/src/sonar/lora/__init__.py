"""LoRA adapters: many fine-tunes of one base model served from one engine.

An adapter is named per request by a :class:`LoRARequest`; the engine loads its PEFT files,
keeps it in one of ``max_loras`` device slots (more in host memory), and every linear layer it
targets adds ``x @ A.T @ B.T * scale`` for the tokens of that adapter's requests, through the
two batched operations of :mod:`sonar.lora.ops`.
"""

from sonar.lora.request import LoRARequest

__all__ = ["LoRARequest"]
