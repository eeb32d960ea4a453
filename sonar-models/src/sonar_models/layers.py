"""Small building blocks shared by the decoder models."""

from __future__ import annotations

import torch
from torch import nn

from sonar import ops
from sonar.quantization import linear_method_for


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Hugging Face does).

    Runs through ``sonar.ops``, so a platform's fused kernel replaces it where registered.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual``; returns ``(norm(residual), residual)`` (may reuse the inputs' memory)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    """A linear layer run by the ``sonar.quantization.LinearMethod`` it holds.

    Unquantized (the default outside a quantized build), it has ``nn.Linear``'s parameters and
    state-dict names and runs through ``sonar.ops.linear``, so a platform's kernel serves the
    shapes it does better. ``prefix`` is the layer's checkpoint module name
    (``model.layers.0.mlp.down_proj``): a quantization method may treat layers differently.

    ``lora`` is set on the layers of a model built with LoRA enabled (``sonar.lora.layers``):
    the base output, whatever the method, gets each adapter token's delta added.
    """

    lora = None  # a sonar.lora.layers.LoRALinear once adapters are attached

    def __init__(self, in_features: int, out_features: int, bias: bool = True, prefix: str = "") -> None:
        super().__init__()
        self._build(in_features, [out_features], bias, prefix)

    def _build(self, in_features: int, output_sizes: list[int], bias: bool, prefix: str) -> None:
        self.in_features = in_features
        self.out_features = sum(output_sizes)
        self.prefix = prefix
        self.linear_method = linear_method_for(prefix)
        self.linear_method.create_weights(self, in_features, output_sizes, bias, torch.get_default_dtype())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x)
        if self.lora is not None:
            out = self.lora.add(x, out)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={type(self.linear_method).__name__}"


class MergedLinear(Linear):
    """A Linear whose output rows are several checkpoint projections stacked in order
    (``{"q": 576, "k": 192, "v": 192}``); the weight loader fills each part separately."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.parts = dict(parts)
        self._build(in_features, list(self.parts.values()), bias, prefix)

    def part_rows(self, part: str) -> slice:
        """The output rows that hold ``part``."""
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(f"{part!r} is not one of this layer's parts {list(self.parts)}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2 * intermediate]`` input (through ``sonar.ops``)."""
    return ops.silu_and_mul(gate_up)
