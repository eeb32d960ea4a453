"""The KV-cache scales a checkpoint may carry per attention layer, for an FP8 KV cache.

Layouts read (``P`` = ``model.layers.N.self_attn``): ``P.k_scale`` and ``P.v_scale`` (compressed-
tensors and vLLM-style FP8 checkpoints), the older ``P.kv_scale`` (one scale for both), and
``P.k_proj.output_scale`` / ``P.v_proj.output_scale`` (AutoFP8). Each is a scalar; a tensor of
several (per-head) scales is taken at its largest, so nothing it covers saturates.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from sonar.model_interface import PagedAttention

# checkpoint leaf under an attention module -> which of the layer's scales it sets
SCALE_LEAVES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),
    "k_proj.output_scale": ("k",),
    "v_proj.output_scale": ("v",),
}
_SCALE_NAME = re.compile(r"^(?P<module>.+\.self_attn)\.(?P<leaf>" + "|".join(re.escape(leaf) for leaf in SCALE_LEAVES) + r")$")


class KVScaleCollector:
    """Takes the KV-cache scales out of a stream of checkpoint tensors (``without_scales``),
    then gives them to the model's attention layers (``apply``)."""

    def __init__(self) -> None:
        self.scales: dict[str, dict[str, float]] = {}  # attention module name -> {"k": .., "v": ..}

    def without_scales(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` less the scale tensors, which are kept here."""
        for name, tensor in weights:
            match = _SCALE_NAME.match(name)
            if match is None:
                yield name, tensor
                continue
            value = float(tensor.detach().float().max())
            for which in SCALE_LEAVES[match["leaf"]]:
                self.scales.setdefault(match["module"], {})[which] = value

    def apply(self, model: nn.Module) -> None:
        """Set each attention layer's scales (1.0 for one of the pair the checkpoint lacks).

        :raises ValueError: a scale names a module that is not an attention layer of ``model``.
        """
        modules = dict(model.named_modules())
        for module_name, scales in self.scales.items():
            attention = getattr(modules.get(module_name), "attn", None)
            if not isinstance(attention, PagedAttention):
                raise ValueError(f"checkpoint KV-cache scale of {module_name!r}: {type(model).__name__} has no such attention layer")
            attention.set_kv_scales(scales.get("k", 1.0), scales.get("v", 1.0))
