"""Reading an adapter's PEFT files: ``adapter_config.json`` and ``adapter_model.safetensors``.

Only safetensors are read (a pickled ``adapter_model.bin`` could run code when loaded); every
tensor is checked against the base model's linear layers before anything reaches a device.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sonar.lora.errors import LoRAError
from sonar.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
KEY_PREFIX = "base_model.model."
# PEFT options Sonar does not run: refused where the config sets them (to a truthy value)
REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained modules beside the adapter) is not supported",
    "lora_bias": "trained LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    "alpha_pattern": "per-module lora_alpha (alpha_pattern) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on parameters, not modules) is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding rows trained beside the adapter) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "use_bdlora is not supported",
}
REFUSED_LEAVES = {
    "lora_magnitude_vector": "DoRA (lora_magnitude_vector) is not supported",
    "lora_embedding_A": "LoRA on embeddings is not supported",
    "lora_embedding_B": "LoRA on embeddings is not supported",
}

NON_LINEAR_TARGETS = {
    "lm_head": "LoRA on lm_head is not supported",
    "embed_tokens": "LoRA on embeddings is not supported",
}


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One checkpoint module an adapter may target: ``model.layers.0.self_attn.q_proj`` with
    its input and output sizes."""

    name: str
    in_features: int
    out_features: int


@dataclass(slots=True)
class LoRAModuleWeights:
    """One targeted module: ``a [r, in]`` and ``b [out, r]`` with the adapter's scale folded in."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter read and checked, its tensors in host memory in the model's dtype."""

    request: LoRARequest
    rank: int  # the largest rank of its modules
    modules: dict[str, LoRAModuleWeights]  # checkpoint module name -> weights

    @property
    def num_bytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def load_adapter(
    request: LoRARequest,
    targets: dict[str, LoRATarget],
    max_rank: int,
    dtype: torch.dtype,
    fused_modules: dict[str, tuple[str, ...]] | None = None,
) -> LoRAAdapter:
    """Read and check the adapter ``request`` names against the base model's ``targets``.

    ``fused_modules`` names the modules a model's checkpoint fuses and its layers split
    (Phi-3's ``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``): an adapter on one of them is
    the same ``lora_A`` for every part and ``lora_B``'s rows split in the parts' order.

    :raises LoRAError: a missing or pickled file, an unsupported PEFT option, a rank above
        ``max_rank``, a module the model has no linear layer for, or a shape that does not
        fit it (the message names the adapter and the field).
    """
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise LoRAError(f"{where}: lora_path is not a folder")
    config = _read_config(folder, where)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [name for name in PICKLED_FILES if (folder / name).exists()]
        if pickled:
            raise LoRAError(
                f"{where}: holds only {pickled[0]}, a pickle, which Sonar never loads; "
                f"save the adapter as {WEIGHTS_FILE} (save_pretrained(..., safe_serialization=True))"
            )
        raise LoRAError(f"{where}: {WEIGHTS_FILE} is missing")
    fused_modules = fused_modules or {}
    rank, alpha, use_rslora, has_rank_pattern = _check_config(config, targets, max_rank, where, set(fused_modules))
    tensors = _split_fused(_read_tensors(weights_path, where), targets, fused_modules, where)
    pairs = _pair_tensors(tensors, targets, where)
    modules: dict[str, LoRAModuleWeights] = {}
    largest = 0
    for name, (a, b) in pairs.items():
        target = targets[name]
        module_rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(f"{where}: {name}: lora_A and lora_B must be matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        if module_rank > max_rank:
            raise LoRAError(f"{where}: {name} has rank {module_rank}, above max_lora_rank={max_rank} (raise --max-lora-rank)")
        if not has_rank_pattern and module_rank != rank:
            raise LoRAError(f"{where}: {name}.lora_A has {module_rank} rows but the config's r is {rank}")
        if a.shape[1] != target.in_features:
            raise LoRAError(
                f"{where}: {name}.lora_A has shape {tuple(a.shape)}, the base model's {name} takes "
                f"{target.in_features} inputs (an adapter for another base model?)"
            )
        if tuple(b.shape) != (target.out_features, module_rank):
            raise LoRAError(
                f"{where}: {name}.lora_B has shape {tuple(b.shape)}, expected {(target.out_features, module_rank)} "
                f"for the base model's {name} (an adapter for another base model?)"
            )
        scale = alpha / (math.sqrt(module_rank) if use_rslora else module_rank)
        modules[name] = LoRAModuleWeights(a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        largest = max(largest, module_rank)
    if not modules:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return LoRAAdapter(request, largest, modules)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{where}: {CONFIG_FILE} is missing")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(
    config: dict[str, Any], targets: dict[str, LoRATarget], max_rank: int, where: str, fused: set[str]
) -> tuple[int, float, bool, bool]:
    """``(r, lora_alpha, use_rslora, has rank_pattern)`` of a config Sonar can run."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type={peft_type!r}: only LORA adapters are supported")
    for option, message in REFUSED_OPTIONS.items():
        if config.get(option):
            raise LoRAError(f"{where}: {message} ({option}={config[option]!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"{where}: bias={bias!r}: trained biases are not supported (only bias='none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{where}: r={rank} is above max_lora_rank={max_rank} (raise --max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRAError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict):
        raise LoRAError(f"{where}: rank_pattern must be an object, got {rank_pattern!r}")
    _check_target_modules(config.get("target_modules"), targets, where, fused)
    return rank, float(alpha), use_rslora, bool(rank_pattern)


def _check_target_modules(target_modules: Any, targets: dict[str, LoRATarget], where: str, fused: set[str]) -> None:
    """A list of module names must name only linear layers the model has; a pattern (a string)
    is checked through the tensors it produced."""
    if target_modules is None or isinstance(target_modules, str):
        return
    if not isinstance(target_modules, list) or not all(isinstance(m, str) for m in target_modules):
        raise LoRAError(f"{where}: target_modules must be a list of module names or a pattern, got {target_modules!r}")
    leaves = {name.rsplit(".", 1)[-1] for name in targets} | fused
    for module in target_modules:
        leaf = module.rsplit(".", 1)[-1]
        if leaf in NON_LINEAR_TARGETS:
            raise LoRAError(f"{where}: {NON_LINEAR_TARGETS[leaf]} (target_modules names {module!r})")
    unknown = sorted(m for m in target_modules if m.rsplit(".", 1)[-1] not in leaves and m not in targets)
    if unknown:
        raise LoRAError(
            f"{where}: target_modules {unknown} are not linear layers LoRA can adapt in this model "
            f"(supported: {', '.join(sorted(leaves))})"
        )


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None


def _split_fused(
    tensors: dict[str, torch.Tensor], targets: dict[str, LoRATarget], fused_modules: dict[str, tuple[str, ...]], where: str
) -> dict[str, torch.Tensor]:
    """``tensors`` with each checkpoint-fused module's ``lora_A`` given to every part and its
    ``lora_B`` rows split among them (see ``load_adapter``)."""
    if not fused_modules:
        return tensors
    split: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        module, _, half = key.removesuffix(".weight").rpartition(".")
        parent, _, leaf = module.rpartition(".")
        parts = fused_modules.get(leaf) if key.endswith(".weight") and half in ("lora_A", "lora_B") else None
        if parts is None:
            split[key] = tensor
            continue
        names = [f"{parent.removeprefix(KEY_PREFIX)}.{part}" for part in parts]
        if any(name not in targets for name in names):
            raise LoRAError(f"{where}: tensor {key}: the base model has no linear layers {names} for the fused {leaf}")
        if half == "lora_A":
            pieces = [tensor] * len(parts)
        else:
            sizes = [targets[name].out_features for name in names]
            if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
                raise LoRAError(
                    f"{where}: {module}.lora_B has shape {tuple(tensor.shape)}, expected {sum(sizes)} rows "
                    f"({' + '.join(map(str, sizes))}) for the base model's {leaf} (an adapter for another base model?)"
                )
            pieces = list(tensor.split(sizes, dim=0))
        for part, piece in zip(parts, pieces):
            split[f"{parent}.{part}.{half}.weight"] = piece
    return split


def _pair_tensors(
    tensors: dict[str, torch.Tensor], targets: dict[str, LoRATarget], where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (lora_A, lora_B)}`` from PEFT's key names
    (``base_model.model.<module>.lora_A.weight``); anything else is refused by name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(KEY_PREFIX)
        for leaf, message in REFUSED_LEAVES.items():
            if f".{leaf}" in name:
                raise LoRAError(f"{where}: {message} (tensor {key})")
        if ".modules_to_save." in name:
            raise LoRAError(f"{where}: modules_to_save is not supported (tensor {key})")
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith((".lora_A", ".lora_B")):
            raise LoRAError(f"{where}: tensor {key} is not a lora_A / lora_B weight (only LoRA on linear layers is supported)")
        module, _, half = module.rpartition(".")
        if module.rsplit(".", 1)[-1] == "lm_head":
            raise LoRAError(f"{where}: LoRA on lm_head is not supported (tensor {key})")
        if module not in targets:
            raise LoRAError(f"{where}: tensor {key}: the base model has no linear layer {module} that LoRA can adapt")
        found.setdefault(module, {})[half] = tensor
    pairs = {}
    for module, halves in found.items():
        if set(halves) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(halves)).pop()
            raise LoRAError(f"{where}: {module} has no {missing} weight")
        pairs[module] = (halves["lora_A"], halves["lora_B"])
    return pairs
