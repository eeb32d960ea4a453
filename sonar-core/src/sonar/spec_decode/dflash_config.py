"""The configuration of a DFlash or DSpark drafter, read from either published layout.

Both layouts describe the same backbone: ``num_hidden_layers`` Qwen3-style draft layers whose
attention also reads the target's hidden states of ``target_layer_ids`` (concatenated, through
``fc`` and ``hidden_norm``), drafting a block of ``block_size`` slots ``[anchor, mask, ...]``
in one non-causal pass. They differ in where their fields live and in what a slot predicts:

- ``zlab`` (``z-lab/*-DFlash-b16``): ``architectures: ["DFlashDraftModel"]``, the ids and the
  mask token under ``dflash_config`` (``target_layer_ids`` defaults to an even spread over
  ``num_target_layers``); slot ``j`` predicts the token at ``anchor + j``, so a block drafts
  ``block_size - 1`` tokens (slot 0, the anchor, predicts nothing).
- ``deepspec`` (DeepSpec's ``dflash_*_block7`` and ``dspark_*_block7``): ``architectures:
  ["Qwen3DSparkModel"]``, ``target_layer_ids``, ``mask_token_id``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head`` and ``confidence_head_with_markov`` at the
  top level; slot ``j`` predicts the token at ``anchor + j + 1``, so a block drafts
  ``block_size`` tokens. A Markov head (``markov_rank > 0``) and a confidence head make it
  DSpark; without them it is DeepSpec's DFlash.

Layer ids follow the checkpoints: ``i`` is the output of target layer ``i`` (Hugging Face's
``hidden_states[i + 1]``), ``-1`` the embedding output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZLAB_ARCHITECTURES = ("DFlashDraftModel",)
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel",)
LAYOUTS = ("deepspec", "zlab")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def spread_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab default: one target layer in the middle for one draft layer, else
    ``num_draft_layers`` ids spread evenly from 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """The fields a DFlash / DSpark drafter is built from (see the module docstring).

    :param layout: ``"deepspec"`` or ``"zlab"``: where the fields are stored and whether
        slot ``j`` predicts ``anchor + j + 1`` (deepspec) or ``anchor + j`` (zlab).
    :param target_layer_ids: the target layers read, in the checkpoint's convention.
    :param num_target_layers: the target's depth the drafter was trained for (None: unknown).
    :param markov_rank: the Markov head's rank (0: none).
    :param layer_types: per draft layer ``"full_attention"`` or ``"sliding_attention"``.
    """

    layout: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_anchors: int = 512
    extra: dict[str, Any] = field(default_factory=dict)  # other fields of the config, kept when saving

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.block_size < (1 if self.layout == "deepspec" else 2):
            raise ValueError(f"block_size must be >= {1 if self.layout == 'deepspec' else 2} in the {self.layout} layout, got {self.block_size}")
        ids = list(self.target_layer_ids)
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ValueError(f"target_layer_ids must be strictly increasing ids from -1 on, got {ids}")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} reach past num_target_layers ({self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES} when markov_rank > 0, got {self.markov_head_type!r}")
        if self.confidence_head_with_markov and not (self.enable_confidence_head and self.markov_rank):
            raise ValueError("confidence_head_with_markov needs enable_confidence_head and markov_rank > 0")
        if (self.markov_rank or self.enable_confidence_head) and self.layout != "deepspec":
            raise ValueError("a Markov or confidence head is only stored in the deepspec layout")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, num_hidden_layers is {self.num_hidden_layers}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    # -- derived ---------------------------------------------------------------------------

    @property
    def is_dspark(self) -> bool:
        """Whether it carries a DSpark head (Markov or confidence)."""
        return bool(self.markov_rank or self.enable_confidence_head)

    @property
    def slot_offset(self) -> int:
        """Slot ``j`` predicts the token at ``anchor + j + slot_offset``."""
        return 1 if self.layout == "deepspec" else 0

    @property
    def num_drafts(self) -> int:
        """Tokens one block drafts."""
        return self.block_size if self.layout == "deepspec" else self.block_size - 1

    @property
    def first_slot(self) -> int:
        """The first slot whose output is a draft."""
        return 0 if self.layout == "deepspec" else 1

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The ids in Sonar's convention (the hidden state entering a layer): ``i + 1``."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of draft layer ``layer`` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    # -- reading and writing -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """From a checkpoint's ``config.json`` in either layout.

        :raises ValueError: not a DFlash/DSpark config, or a field missing or malformed (named).
        """
        layout = layout_of(raw)
        if layout is None:
            names = ", ".join(ZLAB_ARCHITECTURES + DEEPSPEC_ARCHITECTURES)
            raise ValueError(f"not a DFlash or DSpark drafter config (architectures {raw.get('architectures')}; expected {names}, or a dflash_config)")
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size", "block_size"]
        if layout == "deepspec":
            required += ["target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head"]
        missing = [name for name in required if raw.get(name) is None]
        if missing:
            raise ValueError(f"drafter config.json lacks {', '.join(missing)} (needed by the {layout} layout)")
        num_layers = _int(raw, "num_hidden_layers")
        num_target = raw.get("num_target_layers")
        num_target = None if num_target is None else _int(raw, "num_target_layers")
        if layout == "zlab":
            inner = raw.get("dflash_config")
            if not isinstance(inner, dict):
                raise ValueError("drafter config.json lacks dflash_config (an object with mask_token_id and target_layer_ids)")
            if inner.get("mask_token_id") is None:
                raise ValueError("drafter config.json lacks dflash_config.mask_token_id")
            ids = inner.get("target_layer_ids")
            if ids is None:
                if num_target is None:
                    raise ValueError("drafter config.json lacks dflash_config.target_layer_ids (and num_target_layers to derive them)")
                ids = spread_target_layer_ids(num_target, num_layers)
            mask = inner["mask_token_id"]
            markov_rank, markov_type, confidence, with_markov = 0, None, False, False
        else:
            ids, mask = raw["target_layer_ids"], raw["mask_token_id"]
            markov_rank = _int(raw, "markov_rank")
            markov_type = raw.get("markov_head_type")
            if markov_rank and markov_type is None:
                raise ValueError("drafter config.json lacks markov_head_type (markov_rank > 0)")
            confidence = bool(raw["enable_confidence_head"])
            if confidence and raw.get("confidence_head_with_markov") is None:
                raise ValueError("drafter config.json lacks confidence_head_with_markov (enable_confidence_head is true)")
            with_markov = bool(raw.get("confidence_head_with_markov", False)) and confidence
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"drafter config.json: target_layer_ids must be a list of integers, got {ids!r}")
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise ValueError(f"drafter config.json: mask_token_id must be an integer, got {mask!r}")
        heads = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        layer_types = raw.get("layer_types") or ()
        known = set(cls.__dataclass_fields__) | {"dflash_config", "architectures"}
        return cls(
            layout=layout,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=_int(raw, "intermediate_size"),
            vocab_size=_int(raw, "vocab_size"),
            block_size=_int(raw, "block_size"),
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=num_target,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 1e6)),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 40960),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_window=raw.get("sliding_window"),
            layer_types=tuple(layer_types),
            markov_rank=markov_rank,
            markov_head_type=None if markov_type is None else str(markov_type).lower(),
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
            num_anchors=int(raw.get("num_anchors") or 512),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` of this config's layout."""
        raw: dict[str, Any] = {
            **self.extra,
            "model_type": "qwen3",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
        }
        if self.layout == "zlab":
            raw["architectures"] = list(ZLAB_ARCHITECTURES)
            raw["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        else:
            raw["architectures"] = list(DEEPSPEC_ARCHITECTURES)
            raw.update(
                target_layer_ids=list(self.target_layer_ids),
                mask_token_id=self.mask_token_id,
                num_anchors=self.num_anchors,
                markov_rank=self.markov_rank,
                enable_confidence_head=self.enable_confidence_head,
            )
            if self.markov_rank:
                raw["markov_head_type"] = self.markov_head_type
            if self.enable_confidence_head:
                raw["confidence_head_with_markov"] = self.confidence_head_with_markov
        return raw


def layout_of(raw: dict[str, Any]) -> str | None:
    """``"zlab"``, ``"deepspec"`` or None (not a DFlash/DSpark config)."""
    architectures = raw.get("architectures") or []
    if any(a in ZLAB_ARCHITECTURES for a in architectures) or isinstance(raw.get("dflash_config"), dict):
        return "zlab"
    if any(a in DEEPSPEC_ARCHITECTURES for a in architectures):
        return "deepspec"
    return None


def read_dflash_config(folder: str | Path) -> DFlashConfig:
    """The drafter config of ``folder/config.json``.

    :raises ValueError: no config.json, not JSON, or not a DFlash/DSpark config (the field named).
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"drafter {str(folder)!r} has no config.json (expected a DFlash or DSpark checkpoint folder)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    try:
        return DFlashConfig.from_dict(raw)
    except ValueError as error:
        raise ValueError(f"drafter {str(folder)!r}: {error}") from None


def _int(raw: dict[str, Any], name: str) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"drafter config.json: {name} must be an integer, got {value!r}")
    return value
