"""EAGLE-3 checkpoints in the published layout: a folder with ``config.json``
(``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size``,
``norm_before_residual``, optionally ``eagle_aux_hidden_state_layer_ids``) and its weights in
``*.safetensors`` (or ``pytorch_model.bin``, read tensors-only):

- ``fc.weight`` ``[hidden, 3 * target_hidden]``
- ``midlayer.hidden_norm.weight``, ``midlayer.input_layernorm.weight``,
  ``midlayer.post_attention_layernorm.weight`` ``[hidden]``
- ``midlayer.self_attn.{q,k,v}_proj.weight`` ``[heads * head_dim, 2 * hidden]``,
  ``midlayer.self_attn.o_proj.weight`` ``[hidden, heads * head_dim]``
- ``midlayer.mlp.{gate,up}_proj.weight`` ``[intermediate, hidden]``, ``down_proj`` the reverse
- ``norm.weight`` ``[hidden]``, ``lm_head.weight`` ``[draft_vocab, hidden]``
- ``d2t`` ``[draft_vocab]`` int64 (target id = draft id + ``d2t[draft id]``), ``t2d``
  ``[vocab]`` bool (which target ids the draft vocabulary holds)
- ``embed_tokens.weight`` ``[vocab, hidden]`` only where the head has its own embedding;
  otherwise the target's is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sonar.spec_decode.eagle3_head import ARCHITECTURES, Eagle3Config, Eagle3Head

EMBEDDING = "embed_tokens.weight"


def read_eagle3_config(folder: str | Path) -> Eagle3Config:
    """The head's config from ``folder/config.json``.

    :raises ValueError: no config, or an architecture that is not EAGLE-3.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"EAGLE-3 model {str(folder)!r} has no config.json (expected a checkpoint folder)")
    raw = json.loads(path.read_text())
    architectures = raw.get("architectures") or []
    if architectures and not any(a in ARCHITECTURES for a in architectures):
        raise ValueError(f"{str(folder)!r} is a {architectures[0]}, not an EAGLE-3 head ({' or '.join(ARCHITECTURES)})")
    return Eagle3Config.from_dict(raw)


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (or its ``pytorch_model.bin``)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return dict(torch.load(binary, map_location="cpu", weights_only=True))
    raise ValueError(f"EAGLE-3 model {str(folder)!r} has no *.safetensors or pytorch_model.bin")


def load_eagle3(folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> tuple[Eagle3Head, torch.Tensor | None]:
    """The head of ``folder`` in ``dtype`` on ``device``, and its own embedding where the
    checkpoint carries one (None: the target's is shared).

    :raises ValueError: a tensor missing, unexpected or of the wrong shape (named).
    """
    config = read_eagle3_config(folder)
    tensors = read_tensors(folder)
    embedding = tensors.pop(EMBEDDING, None)
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[-1] % config.target_hidden_size == 0:
        config = _with_aux_count(config, fc.shape[-1] // config.target_hidden_size)
    head = Eagle3Head(config)
    expected = head.state_dict()
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)  # the identity map
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 checkpoint {str(folder)!r}: missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"EAGLE-3 checkpoint {str(folder)!r}: {name} is {list(tensor.shape)}, expected {list(expected[name].shape)}")
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    head.load_state_dict(tensors)
    head = head.to(device=device)
    for name, param in head.named_parameters():
        param.data = param.data.to(dtype)
    target_ids = torch.arange(config.draft_vocab_size) + head.d2t.cpu()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size:
        raise ValueError(f"EAGLE-3 checkpoint {str(folder)!r}: d2t maps draft ids outside the target vocabulary of {config.vocab_size}")
    if embedding is not None:
        if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"EAGLE-3 checkpoint {str(folder)!r}: {EMBEDDING} is {list(embedding.shape)}, expected {[config.vocab_size, config.hidden_size]}")
        embedding = embedding.to(device=device, dtype=dtype)
    return head, embedding


def save_eagle3(head: Eagle3Head, folder: str | Path, embedding: torch.Tensor | None = None) -> Path:
    """Write ``head`` as an EAGLE-3 checkpoint folder (config.json + model.safetensors);
    ``embedding``, where given, is stored as the head's own ``embed_tokens.weight``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    if embedding is not None:
        tensors[EMBEDDING] = embedding.detach().contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _with_aux_count(config: Eagle3Config, count: int) -> Eagle3Config:
    from dataclasses import replace

    return config if count == config.num_aux_layers else replace(config, num_aux_layers=count)
