"""A Hugging Face model folder: config.json, one or many ``*.safetensors``, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

from sonar_models.formats.tokenizer_files import load_folder_tokenizer

SHARD_INDEX = "model.safetensors.index.json"


class SafetensorsFormat:
    """Reads Hugging Face folders; tensors are streamed one at a time with ``safe_open``."""

    name = "safetensors"

    def detect(self, model_path: Path) -> bool:
        """A folder with a config.json and at least one ``*.safetensors`` file."""
        model_path = Path(model_path)
        return model_path.is_dir() and (model_path / "config.json").is_file() and any(model_path.glob("*.safetensors"))

    def load_hf_config(self, model_path: Path) -> Any:
        """``AutoConfig.from_pretrained`` on the folder."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(Path(model_path))

    def load_tokenizer(self, model_path: Path) -> Any | None:
        """The folder's tokenizer, or None where the folder has no tokenizer files."""
        return load_folder_tokenizer(Path(model_path))

    def iter_weights(self, model_path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every shard under its Hugging Face name, read one at a time."""
        from safetensors import safe_open

        for shard in shard_files(Path(model_path)):
            with safe_open(str(shard), framework="pt") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)


def shard_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those the shard index names, else every ``*.safetensors``."""
    index = folder / SHARD_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in the folder: {missing}")
        return [folder / name for name in names]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return shards
