"""``compressed-tensors`` checkpoints (llm-compressor's layout) with FP8 W8A8 schemes.

Supported: ``format`` ``float-quantized`` or ``naive-quantized``; weights ``{num_bits: 8,
type: float, strategy: tensor | channel, dynamic: false}`` (``weight`` float8_e4m3fn
``[out, in]``, ``weight_scale`` ``[1]`` or ``[out, 1]``); input activations ``{strategy:
tensor, dynamic: false}`` (a static ``input_scale``) or ``{strategy: token, dynamic: true}``.
Layers named by ``ignore`` (``lm_head``, ``re:`` patterns) stay in floating point. Every other
scheme (int4 ``pack-quantized``, int8, group or block strategies, weight-only FP8) is refused
at load with a message naming what is supported. The layers run as ``sonar.quantization.fp8``
runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sonar.quantization import ExpertsMethod, LinearMethod, QuantizationMethod, UnquantizedLinearMethod
from sonar.quantization.fp8 import Fp8ExpertsMethod, Fp8LinearMethod, is_ignored

SUPPORTED = (
    "FP8 W8A8: formats float-quantized/naive-quantized, weights {num_bits 8, type float, strategy tensor|channel, "
    "dynamic false}, input_activations {strategy tensor, dynamic false} or {strategy token, dynamic true}"
)
FORMATS = ("float-quantized", "naive-quantized")


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    """One config group's FP8 scheme: whether its activations use a static per-tensor scale."""

    static_activations: bool


def _refuse(what: str) -> ValueError:
    return ValueError(f"compressed-tensors {what} is not supported; supported: {SUPPORTED}")


def parse_scheme(group_name: str, group: dict[str, Any]) -> Fp8Scheme:
    """The FP8 scheme of config group ``group_name``.

    :raises ValueError: the group is not an FP8 W8A8 scheme Sonar runs (the message says why).
    """
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise _refuse(f"group {group_name!r} weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}")
    if weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic"):
        raise _refuse(f"group {group_name!r} weight strategy {weights.get('strategy')!r} (dynamic {weights.get('dynamic')})")
    inputs = group.get("input_activations")
    if not inputs:
        raise _refuse(f"group {group_name!r} without input_activations (FP8 weight-only)")
    if (inputs.get("num_bits"), inputs.get("type")) != (8, "float"):
        raise _refuse(f"group {group_name!r} input activations of {inputs.get('num_bits')} bits, type {inputs.get('type')!r}")
    scheme = (inputs.get("strategy"), bool(inputs.get("dynamic")))
    if scheme not in (("tensor", False), ("token", True)):
        raise _refuse(f"group {group_name!r} input activation strategy {scheme[0]!r} with dynamic {scheme[1]}")
    if "Linear" not in group.get("targets", ["Linear"]):
        raise _refuse(f"group {group_name!r} targets {group.get('targets')}")
    return Fp8Scheme(static_activations=scheme == ("tensor", False))


class CompressedTensorsMethod(QuantizationMethod):
    """``compressed-tensors``: every linear layer but the ignored ones in FP8, the scheme of the
    checkpoint's config group (one scheme for the model)."""

    name = "compressed-tensors"
    platforms = ("cpu", "cuda")
    reads = "FP8 W8A8: float8_e4m3fn weight, per-tensor or per-channel weight_scale, static input_scale or dynamic per-token"
    execution = {
        "cpu": "FP8 in memory, dequantized per call; activations quantized as on the GPU; a mixture-of-experts layer's "
        "experts FP8 in memory, each dequantized per call over its tokens (activations unquantized)",
        "cuda": "fused Triton GEMV for one row, torch._scaled_mm row-wise otherwise; a mixture-of-experts layer's experts "
        "FP8 in the fused Triton MoE kernel (W8A16)",
    }
    tested_by = {"cpu": "tests/test_quant_fp8.py", "cuda": "tests/test_quant_cuda.py"}

    def __init__(self, scheme: Fp8Scheme, ignore: list[str]) -> None:
        self.scheme = scheme
        self.ignore = ignore

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> CompressedTensorsMethod:
        fmt = quant_config.get("format")
        if fmt not in FORMATS:
            raise _refuse(f"format {fmt!r}")
        groups = quant_config.get("config_groups") or {}
        if not groups:
            raise _refuse("quantization_config without config_groups")
        schemes = {parse_scheme(name, group) for name, group in groups.items()}
        if len(schemes) != 1:
            raise _refuse("mixing static and dynamic activation schemes across config groups")
        return cls(schemes.pop(), list(quant_config.get("ignore") or []))

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        if is_ignored(layer_prefix, self.ignore):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(static_activations=self.scheme.static_activations)

    def experts_method(self, layer_prefix: str) -> ExpertsMethod | None:
        """The experts in FP8 (``sonar.quantization.fp8.Fp8ExpertsMethod``) unless the ignore list
        names them."""
        if is_ignored(f"{layer_prefix}.0.gate_proj", self.ignore):
            return None
        return Fp8ExpertsMethod(static_activations=self.scheme.static_activations)
