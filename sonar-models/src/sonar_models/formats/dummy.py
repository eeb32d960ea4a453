"""Random weights from a config alone (``load_format="dummy"``), for benchmarks and tests.

The engine calls ``init_weights``: it draws every parameter of the built model in place, on
the model's own device (nothing is streamed from host memory): norm weights 1, biases 0,
everything else normal(0, 0.02) from a fixed seed. ``iter_weights`` yields the same kind of
tensors under Hugging Face names, for tools that load weights by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from sonar_models.formats.gguf_file import GGUFFormat
from sonar_models.formats.tokenizer_files import load_folder_tokenizer

INIT_STD = 0.02
SEED = 0


class DummyFormat:
    """Never auto-detected; forced by ``load_format="dummy"``. Reads the config (and tokenizer,
    where present) of a folder or a ``.gguf`` file and ignores any weights there."""

    name = "dummy"

    def detect(self, model_path: Path) -> bool:
        """Always False: random weights are only ever asked for explicitly."""
        return False

    def load_hf_config(self, model_path: Path) -> Any:
        """``config.json`` of a folder (or the metadata of a ``.gguf`` file)."""
        model_path = Path(model_path)
        if GGUFFormat().detect(model_path):
            return GGUFFormat().load_hf_config(model_path)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path)

    def load_tokenizer(self, model_path: Path) -> Any | None:
        """The tokenizer next to the config, or None where there is none."""
        model_path = Path(model_path)
        if GGUFFormat().detect(model_path):
            return GGUFFormat().load_tokenizer(model_path)
        return load_folder_tokenizer(model_path)

    def init_weights(self, model: torch.nn.Module) -> None:
        """Fill the built model's parameters in place on their device, from a fixed seed."""
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(SEED)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1 and "norm" in name:
                    param.fill_(1.0)
                elif param.element_size() == 1 and param.is_floating_point():  # fp8: drawn in float32, rounded
                    param.copy_(torch.empty(param.shape, device=device).normal_(0.0, INIT_STD, generator=generator))
                elif not param.is_floating_point():  # packed integer weights (int4 qweight): random bits
                    param.random_(generator=generator)
                else:
                    param.normal_(0.0, INIT_STD, generator=generator)

    def iter_weights(self, model_path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """A random float32 tensor for every parameter of the config's Hugging Face model."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        generator = torch.Generator().manual_seed(SEED)
        for name, param in skeleton.named_parameters():  # tied lm_head appears once, as the embedding
            yield name, random_init(name, tuple(param.shape), generator)


def random_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases 0, other tensors normal(0, ``INIT_STD``)."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)
