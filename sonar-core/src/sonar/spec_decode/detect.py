"""The speculative method a drafter folder implies, for a ``speculative_config`` that names a
``model`` but no ``method`` (or ``"method": "auto"``). Reads ``config.json`` only (no torch).

- DeepSpec's ``Qwen3DSparkModel`` with a Markov or confidence head: ``dspark``;
- z-lab's ``DFlashDraftModel`` (or a ``dflash_config``), or DeepSpec's without those heads:
  ``dflash``;
- an EAGLE-3 head (``LlamaForCausalLMEagle3``, ``Eagle3LlamaForCausalLM``): ``eagle3``;
- any other model folder: ``draft_model`` (a small causal LM of the target's vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

AUTO_METHODS = ("auto",)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def detect_method(folder: str) -> str:
    """The method for the drafter in ``folder``.

    :raises ValueError: no readable ``config.json`` there.
    """
    from sonar.spec_decode.dflash_config import layout_of

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(
            f'speculative_config: no "method" given and {str(folder)!r} has no readable config.json to tell it from '
            '(give "method": "ngram", "draft_model", "eagle3", "dflash" or "dspark")'
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    layout = layout_of(raw)
    if layout == "deepspec" and (raw.get("markov_rank") or raw.get("enable_confidence_head")):
        return "dspark"
    if layout is not None:
        return "dflash"
    if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or []):
        return "eagle3"
    return "draft_model"
