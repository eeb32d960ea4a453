"""Quantization methods: how a checkpoint's tensors map to a linear layer's runtime tensors, and
how the layer runs them.

Every linear layer of a Sonar model holds a ``LinearMethod``; the unquantized one is a method
like any other, so a model stays plain PyTorch and a third-party format is a plugin that
registers a ``QuantizationMethod`` through ``sonar_register_quantization_methods``.

A model learns its method from the context it is built in (``building_with``): the model
runner builds every model inside ``building_with(method)``, and a layer asks
``linear_method_for(prefix)`` when it is constructed. Outside that context (a model built by
hand, in a test) every layer is unquantized. The experts of a mixture-of-experts layer are not
linear layers: a format that keeps them quantized gives them an ``ExpertsMethod``
(``experts_method_for``).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from sonar import ops


class LinearMethod:
    """How one linear layer holds and runs its weights.

    ``create_weights`` registers the layer's runtime parameters on it; ``load_checkpoint_tensor``
    copies one checkpoint tensor (or one fused part of it) into them; ``apply`` computes the
    layer's output. Parameters stacked from several checkpoint projections (fused q/k/v,
    gate/up) hold each part's rows in order along dimension 0, as ``layer.part_rows(part)``
    says.

    Under tensor parallelism (``supports_tensor_parallel``), ``shard_checkpoint_tensor`` first
    cuts each full checkpoint tensor into the rank's piece (``sonar.quantization.sharding``).
    """

    #: whether ``shard_checkpoint_tensor`` cuts this method's tensors for column- and
    #: row-parallel layers (a method without it runs at tensor_parallel_size=1 only)
    supports_tensor_parallel: ClassVar[bool] = False

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        """Register ``layer``'s parameters for ``in_features`` inputs and ``sum(output_sizes)``
        outputs (one size per fused part, in order), in ``dtype`` where they are floating."""
        raise NotImplementedError

    def load_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: slice | None) -> None:
        """Copy the checkpoint tensor that fills ``layer``'s parameter ``param_name`` (the
        checkpoint's own leaf name, ``weight``, ``weight_scale``, ``bias``), into output rows
        ``rows`` (None: the whole parameter).

        :raises ValueError: the tensor's shape does not fit.
        """
        param = getattr(layer, param_name)
        dest = param.data if rows is None else param.data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, but the model expects {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: Any, part: str | None) -> Any:
        """This rank's piece of the full checkpoint tensor filling ``param_name`` (of fused
        part ``part``) of a column- or row-parallel ``layer``, before ``load_checkpoint_tensor``.

        :raises ValueError: the piece would split a quantization group or block.
        """
        raise NotImplementedError(f"{type(self).__name__} does not shard for tensor parallelism")

    def takes_prepared_input(self, layer: nn.Module) -> str | None:
        """The form in which ``layer`` can take its input already prepared by the norm that
        feeds it (computed in the norm's own kernel, so no separate pass prepares it here), or
        None (the default): ``"fp8_rows"``, the input quantized to FP8 per token
        (``sonar.quantization.fp8.Fp8Rows``). ``apply`` then receives it as ``prepared``."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, prepared: Any = None) -> torch.Tensor:
        """``layer``'s output for input ``x`` ``[..., in_features]``; ``prepared``: ``x`` in
        the form ``takes_prepared_input`` named, where the norm before the layer made it."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """Floating-point ``weight [out, in]`` and optional ``bias [out]``, run by ``sonar.ops.linear``
    (so a platform's GEMM serves it); the parameters and names of ``nn.Linear``."""

    supports_tensor_parallel = True

    def create_weights(
        self, layer: nn.Module, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        out_features = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(layer.weight, a=5**0.5)  # as nn.Linear, for models built without a checkpoint
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)

    def shard_checkpoint_tensor(self, layer: nn.Module, param_name: str, tensor: Any, part: str | None) -> Any:
        from sonar.quantization.sharding import dense_shard

        return dense_shard(layer, param_name, tensor, part)

    def apply(self, layer: nn.Module, x: torch.Tensor, prepared: Any = None) -> torch.Tensor:
        return ops.linear(x, layer.weight, layer.bias)


class ExpertsMethod:
    """How the experts of one mixture-of-experts layer hold and run their weights, where a
    format keeps them quantized (``QuantizationMethod.experts_method``).

    The layer holds ``E`` SiLU-gated MLPs (``sonar.moe``); a checkpoint fills them one expert
    projection at a time. Without an experts method they are two stacked floating parameters,
    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, run by ``sonar.moe.fused_moe``; a method registers
    parameters under those two names too (so the loader finds them), holding whatever it keeps.
    ``checkpoint_tensors`` names the tensors of each projection the checkpoint holds
    (``weight``, and a format's scales: ``weight_scale``).
    """

    checkpoint_tensors: tuple[str, ...] = ("weight",)

    @staticmethod
    def hold_whole_experts(layer: nn.Module, what: str, placeholder_dtype: torch.dtype = torch.uint8) -> None:
        """For a method that holds whole experts: refuse a layer whose experts' intermediate
        size is split over tensor-parallel ranks (naming ``what`` it holds), and register empty
        ``w13`` / ``w2`` for the loader to find by name."""
        if layer.split_intermediate:
            raise NotImplementedError(f"{what} do not split their intermediate size over tensor-parallel ranks; "
                                      "add enable_expert_parallel to place whole experts on each rank")
        layer.w13 = nn.Parameter(torch.empty(0, dtype=placeholder_dtype), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(0, dtype=placeholder_dtype), requires_grad=False)

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """Register ``layer.w13`` and ``layer.w2`` for ``num_experts`` experts of
        ``intermediate_size`` (this rank's) over ``hidden_size`` inputs."""
        raise NotImplementedError

    def load_checkpoint_part(self, layer: nn.Module, leaf: str, tensor: Any, part: tuple[int, str, str]) -> None:
        """Take one tensor of an expert's projection: ``part`` is ``(local expert index, "gate"
        | "up" | "down", tensor name)`` (one of ``checkpoint_tensors``), ``tensor`` the
        checkpoint's (the weight ``[rows, cols]``) in whatever form the format's reader gives,
        filling parameter ``leaf`` (``"w13"`` / ``"w2"``)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``sonar.moe.fused_moe``'s result for ``layer``'s experts: ``[T, H]`` in ``x``'s dtype
        (``layer.expert_map`` maps global expert ids to local ones where the layer holds some)."""
        raise NotImplementedError


class _Projection(nn.Module):
    """One expert projection held as a linear layer of a ``LinearMethod`` (``LinearExpertsMethod``)."""

    parallel = "replicated"

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix


class LinearExpertsMethod(ExpertsMethod):
    """Experts whose projections a format stores as it stores any linear layer (GPTQ and AWQ's
    ``qweight``/``qzeros``/``scales``): each expert's gate, up and down held by the format's own
    ``LinearMethod`` (``linear_method(prefix)``, ``prefix`` the projection's checkpoint name).

    On the CPU each projection runs as that method runs a layer, over the tokens routed to its
    expert. Elsewhere (a GPU, whose decode graphs cannot read the routing on the host), once the
    last expert has arrived, every projection is dequantized by applying it to the identity (exact
    for weight-only formats) into the stacked floating weights of ``sonar.moe.fused_moe``."""

    def __init__(self, linear_method: Callable[[str], LinearMethod], checkpoint_tensors: tuple[str, ...]) -> None:
        self.linear_method = linear_method
        self.checkpoint_tensors = checkpoint_tensors

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        self.hold_whole_experts(layer, "a quantized checkpoint's experts")
        dtype = torch.get_default_dtype()
        first = layer.placement.first
        projections = []  # a plain list: the loader fills these through load_checkpoint_part, not by name
        for expert in range(num_experts):
            held = {}
            for name, (inputs, outputs) in (("gate", (hidden_size, intermediate_size)), ("up", (hidden_size, intermediate_size)), ("down", (intermediate_size, hidden_size))):
                prefix = f"{layer.prefix}.{first + expert}.{name}_proj"
                projection = _Projection(prefix)
                projection.linear_method = self.linear_method(prefix)
                projection.linear_method.create_weights(projection, inputs, [outputs], False, dtype)
                held[name] = projection
            projections.append(held)
        layer.linear_experts = projections
        layer.linear_sizes = (hidden_size, intermediate_size)
        layer.linear_pending = {e: len(self.checkpoint_tensors) * 3 for e in range(num_experts)}

    def load_checkpoint_part(self, layer: nn.Module, leaf: str, tensor: Any, part: tuple[int, str, str]) -> None:
        expert, name, kind = part
        projection = layer.linear_experts[expert][name]
        projection.linear_method.load_checkpoint_tensor(projection, kind, tensor, None)
        layer.linear_pending[expert] -= 1
        if not layer.linear_pending[expert]:
            del layer.linear_pending[expert]
            if not layer.linear_pending and layer.w13.device.type != "cpu":
                self._dequantize(layer)

    def _dequantize(self, layer: nn.Module) -> None:
        """Every projection as ``W = apply(I).T``, stacked for ``fused_moe`` (the quantized ones dropped)."""
        def floating(projection: nn.Module, inputs: int) -> torch.Tensor:
            identity = torch.eye(inputs, dtype=torch.get_default_dtype(), device=layer.w13.device)
            return projection.linear_method.apply(projection, identity).t()

        hidden, intermediate = layer.linear_sizes
        w13 = torch.stack([torch.cat([floating(e["gate"], hidden), floating(e["up"], hidden)]) for e in layer.linear_experts])
        w2 = torch.stack([floating(e["down"], intermediate) for e in layer.linear_experts])
        layer.w13 = nn.Parameter(w13, requires_grad=False)
        layer.w2 = nn.Parameter(w2, requires_grad=False)
        layer.linear_experts = None

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from sonar.moe import experts_by_group, fused_moe

        if layer.linear_experts is None:
            return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.expert_map)

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            held = layer.linear_experts[expert]
            run = lambda name, inputs: held[name].linear_method.apply(held[name], inputs)  # noqa: E731
            return run("down", torch.nn.functional.silu(run("gate", rows)) * run("up", rows))

        return experts_by_group(x, topk_weights, topk_ids, layer.expert_map, len(layer.linear_experts), expert_mlp)


class QuantizationMethod:
    """A quantization format: which platforms run it and which ``LinearMethod`` each layer gets.

    Subclasses set ``name`` (what ``quantization=`` takes and what a checkpoint's
    ``config.json`` carries in ``quantization_config.quant_method``) and ``platforms`` (the
    platform names, as ``SONAR_PLATFORM`` takes them, that run it; None: every platform), and
    build themselves from the checkpoint's ``quantization_config`` in ``from_config``.
    """

    name: ClassVar[str]
    platforms: ClassVar[tuple[str, ...] | None] = None
    #: the checkpoint layouts it reads, one line (the generated quantization matrix shows it)
    reads: ClassVar[str] = ""
    #: platform name -> how a linear layer runs there, one line ("Triton int4 GEMM", "dequantized per layer")
    execution: ClassVar[dict[str, str]] = {}
    #: platform name -> the test that runs this format end to end there, greedy against
    #: transformers ("sonar-core/tests/test_quant_gptq.py"); a platform absent here is untested
    tested_by: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> QuantizationMethod:
        """The method for a checkpoint whose ``config.json`` has ``quantization_config``
        ``quant_config`` (``{}`` when ``quantization=`` forces a method on a checkpoint without one)."""
        return cls()

    @classmethod
    def runs_on(cls, platform: str) -> bool:
        """Whether the platform named ``platform`` runs this format."""
        return cls.platforms is None or platform in cls.platforms

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        """The ``LinearMethod`` of the linear layer at ``layer_prefix``: its module name in the
        model (``model.layers.0.mlp.down_proj``, fused ones ``...self_attn.qkv_proj``), ``""``
        where the model did not name it."""
        raise NotImplementedError

    def experts_method(self, layer_prefix: str) -> ExpertsMethod | None:
        """The ``ExpertsMethod`` of the mixture-of-experts layer at ``layer_prefix``
        (``model.layers.0.mlp.experts``); None (the default): the experts are floating-point
        stacked tensors, and a checkpoint's must come floating."""
        return None


class UnquantizedMethod(QuantizationMethod):
    """Every linear layer in floating point (registered as ``"unquantized"``)."""

    name = "unquantized"
    reads = "floating-point checkpoints (float32, bfloat16, float16)"
    execution = {"cpu": "torch matmul", "cuda": "library GEMM; Triton GEMV for one row"}
    tested_by = {"cpu": "sonar-models/tests/test_llama_vs_hf.py", "cuda": "sonar-cuda/tests/test_cuda_engine.py"}

    def linear_method(self, layer_prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()


_building_with: contextvars.ContextVar[QuantizationMethod | None] = contextvars.ContextVar("sonar_quantization", default=None)


@contextlib.contextmanager
def building_with(method: QuantizationMethod) -> Iterator[None]:
    """Models built inside this context give their linear layers ``method``'s linear methods."""
    token = _building_with.set(method)
    try:
        yield
    finally:
        _building_with.reset(token)


def linear_method_for(layer_prefix: str) -> LinearMethod:
    """The ``LinearMethod`` a linear layer at ``layer_prefix`` built now holds (unquantized
    outside ``building_with``)."""
    method = _building_with.get()
    return UnquantizedLinearMethod() if method is None else method.linear_method(layer_prefix)


#: a mixture-of-experts router (and Qwen2-MoE's shared-expert gate): floating in every published
#: quantized checkpoint (FP8, GPTQ, AWQ), listed in its ignore list or not
_ROUTER = re.compile(r".*\.mlp\.(gate|shared_expert_gate)$")


def is_router(layer_prefix: str) -> bool:
    """Whether the linear layer at ``layer_prefix`` routes tokens to experts (formats leave it unquantized)."""
    return _ROUTER.fullmatch(layer_prefix) is not None


def experts_method_for(layer_prefix: str) -> ExpertsMethod | None:
    """The ``ExpertsMethod`` a mixture-of-experts layer at ``layer_prefix`` built now holds
    (None: stacked floating tensors; always outside ``building_with``)."""
    method = _building_with.get()
    return None if method is None else method.experts_method(layer_prefix)


def quant_config_of(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (None: the checkpoint declares none)."""
    quant_config = getattr(hf_config, "quantization_config", None)
    if quant_config is None:
        return None
    return quant_config if isinstance(quant_config, dict) else quant_config.to_dict()


def quantization_method_of(model_config: Any) -> QuantizationMethod:
    """The method a ``ModelConfig``'s model is built with: its registered ``quantization``,
    built from the checkpoint's ``quantization_config`` (``UnquantizedMethod`` when None)."""
    from sonar.registry import load_registered, quantization_methods

    name = model_config.quantization or "unquantized"
    method_cls = load_registered("quantization method", name, quantization_methods())
    return method_cls.from_config(quant_config_of(model_config.hf_config) or {})
