"""Auxiliary hidden states: what a decoder's normal forward pass leaves at the input of chosen
layers, kept for a drafter that reads them (EAGLE-3 concatenates three of them).

Layer id ``i`` is the hidden state entering decoder layer ``i`` (the residual stream after
layers ``0 .. i-1``), the convention of the EAGLE-3 checkpoints and of Hugging Face's
``output_hidden_states[i]``. The ids are set once, after the model is built; with none set
the layer loop does nothing extra.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default choice, ``(2, L // 2, L - 3)``; for a model too shallow for three
    distinct ids of that form, three evenly spread layers from 1 on (fewer when it has fewer)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids) and ids == tuple(sorted(ids)):
        return ids
    candidates = list(range(1, num_layers)) or [0]
    if len(candidates) <= 3:
        return tuple(candidates)
    step = len(candidates) / 3
    return tuple(candidates[int(step * (n + 0.5))] for n in range(3))


class AuxHiddenStates:
    """The chosen layers' input hidden states of the latest forward pass.

    ``latest`` is ``[num_tokens, len(layer_ids) * hidden]``: the states in ascending layer
    order, concatenated along the last dimension (None before a forward with layers chosen).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layer_ids: frozenset[int] = frozenset()
        self.latest: torch.Tensor | None = None

    def select(self, layer_ids: Sequence[int]) -> None:
        """Keep the inputs of these layers from now on (empty: keep nothing).

        :raises ValueError: an id outside ``0 .. num_layers - 1`` or one given twice.
        """
        ids = [int(i) for i in layer_ids]
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_layers for i in ids):
            raise ValueError(f"auxiliary hidden-state layers {ids} must be distinct ids in 0..{self.num_layers - 1}")
        self.layer_ids = frozenset(ids)
        self.latest = None

    def default_layer_ids(self) -> tuple[int, ...]:
        """EAGLE-3's default layers for this model (see ``default_aux_layer_ids``)."""
        return default_aux_layer_ids(self.num_layers)

    @property
    def ordered_ids(self) -> list[int]:
        """The chosen ids in the order their states are concatenated."""
        return sorted(self.layer_ids)

    @staticmethod
    def layer_input(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The residual stream entering a layer, as a tensor of its own (the layers' fused
        add-and-norm may later write into ``hidden`` and ``residual``)."""
        return hidden.clone() if residual is None else hidden + residual
