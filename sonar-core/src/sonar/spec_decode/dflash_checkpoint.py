"""DFlash and DSpark checkpoints in their published layouts: ``config.json`` (see
``sonar.spec_decode.dflash_config``) and ``*.safetensors``:

- ``fc.weight`` ``[hidden, len(target_layer_ids) * hidden]``, ``hidden_norm.weight``,
  ``norm.weight`` ``[hidden]``
- per draft layer ``layers.N.``: ``self_attn.q_proj.weight`` ``[heads * head_dim, hidden]``,
  ``self_attn.{k,v}_proj.weight`` ``[kv_heads * head_dim, hidden]``, ``self_attn.o_proj.weight``
  ``[hidden, heads * head_dim]`` (biases where ``attention_bias``), ``self_attn.{q,k}_norm.weight``
  ``[head_dim]``, ``mlp.{gate,up}_proj.weight`` ``[intermediate, hidden]``,
  ``mlp.down_proj.weight`` ``[hidden, intermediate]``, ``input_layernorm.weight``,
  ``post_attention_layernorm.weight`` ``[hidden]``
- deepspec layout only: ``embed_tokens.weight`` and ``lm_head.weight`` ``[vocab, hidden]`` (frozen
  copies of the target's: their shapes are checked, the target's own are used); with
  ``markov_rank > 0`` ``markov_head.markov_w1.weight`` and ``markov_head.markov_w2.weight``
  ``[vocab, rank]``, plus ``markov_head.gate_proj.{weight,bias}`` ``[rank, hidden + rank]``
  (gated) or ``markov_head.joint_proj.{weight,bias}`` ``[3 * rank, 2 * rank + hidden]`` (rnn);
  with a confidence head ``confidence_head.proj.weight`` ``[1, hidden (+ rank)]`` and its bias.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from sonar.spec_decode.dflash_config import DFlashConfig, read_dflash_config
from sonar.spec_decode.dflash_model import DFlashDrafter
from sonar.spec_decode.eagle3_checkpoint import read_tensors

SHARED = ("embed_tokens.weight", "lm_head.weight")  # the deepspec layout's copies of the target's


def load_dflash(folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> DFlashDrafter:
    """The drafter of ``folder`` in ``dtype`` on ``device``.

    :raises ValueError: a config field missing or malformed, a tensor missing, unexpected or
        of the wrong shape (each named).
    """
    config = read_dflash_config(folder)
    drafter = DFlashDrafter(config)
    try:
        tensors = read_tensors(folder)
    except ValueError:
        raise ValueError(f"drafter {str(folder)!r} has no *.safetensors or pytorch_model.bin") from None
    for name in SHARED:
        shared = tensors.pop(name, None)
        if shared is not None and tuple(shared.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"drafter {str(folder)!r}: {name} is {list(shared.shape)}, expected [vocab_size, hidden_size] = "
                f"{[config.vocab_size, config.hidden_size]}"
            )
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"drafter {str(folder)!r}: missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'} (config: {_summary(config)})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"drafter {str(folder)!r}: {name} is {list(tensor.shape)}, expected {list(expected[name].shape)} ({_summary(config)})")
    drafter.load_state_dict(tensors)
    return drafter.to(device=device, dtype=dtype).eval()


def save_dflash(
    drafter: DFlashDrafter,
    folder: str | Path,
    layout: str | None = None,
    embedding: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
) -> Path:
    """Write ``drafter`` as a checkpoint folder (config.json + model.safetensors) in ``layout``
    (default: its config's). The deepspec layout carries the target's ``embedding`` and
    ``lm_head`` weights ``[vocab, hidden]`` (DeepSpec's own loader reads them); pass them for it.

    :raises ValueError: a DSpark head in the zlab layout, or the deepspec layout without the
        target's weights.
    """
    from safetensors.torch import save_file

    config = drafter.config if layout is None or layout == drafter.config.layout else replace(drafter.config, layout=layout)
    if config.layout == "deepspec" and (embedding is None or lm_head is None):
        raise ValueError("the deepspec layout stores the target's embed_tokens and lm_head weights: pass embedding and lm_head")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict()
    raw["torch_dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in drafter.state_dict().items()}
    if config.layout == "deepspec":
        dtype = next(drafter.parameters()).dtype
        tensors["embed_tokens.weight"] = embedding.detach().to(dtype).contiguous().cpu()
        tensors["lm_head.weight"] = lm_head.detach().to(dtype).contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _summary(config: DFlashConfig) -> str:
    return (
        f"{config.layout} layout, hidden_size {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{len(config.target_layer_ids)} target layers, vocab_size {config.vocab_size}, markov_rank {config.markov_rank}"
    )
