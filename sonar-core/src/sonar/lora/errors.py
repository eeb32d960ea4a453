"""What goes wrong with an adapter, as the engine tells its callers."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served: its files are missing, pickled, of a PEFT feature Sonar
    does not run (DoRA, ``modules_to_save``, embedding or ``lm_head`` LoRA, trained biases), of
    a rank above ``max_lora_rank``, or shaped for another base model; or an engine started
    without ``enable_lora``. The message names the adapter and the bad field."""


class LoRAInUseError(LoRAError):
    """An adapter cannot be changed while requests use it (its id names another adapter, or
    it is being removed and takes no new requests)."""
