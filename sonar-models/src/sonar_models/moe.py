"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

Llama's decoder (``sonar_models.llama``) with the MLP of some layers replaced by a sparse
block: a router (one linear layer, ``[T, hidden] -> [T, E]``) picks each token's top ``k``
experts, and the experts, stacked per layer into ``w13 [E, 2 * I, hidden]`` and
``w2 [E, hidden, I]``, run through ``sonar.moe.fused_moe`` (a platform's fused kernel where
one is registered, else tokens grouped by expert in torch).

Checkpoints come in two layouts, both read: one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``),
which is what transformers writes, and transformers' in-memory stacking
(``mlp.experts.gate_up_proj [E, 2 * I, hidden]``, ``mlp.experts.down_proj``).

Under tensor parallelism (``sonar.distributed``) the router is replicated and either every
expert's intermediate dimension is split over the ranks (each rank its slice of the gate, of
the up and of the down projection's input columns), or, with ``expert_parallel``, each rank
holds whole experts (``sonar_models.expert_parallel``). Either way the block ends with one
all-reduce, which also sums the shared expert's partial outputs.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from sonar.distributed import current_group
from sonar.moe import fused_moe
from sonar.quantization import experts_method_for
from sonar_models.expert_parallel import expert_placement, run_experts_across_ranks, token_slice
from sonar_models.layers import Linear
from sonar_models.llama import GatedMLP, LlamaForCausalLM

# "model.layers.0.mlp.experts.3.gate_proj.weight" -> ("model.layers.0.mlp.experts", "3", "gate_proj")
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
# transformers' stacked layout: "model.layers.0.mlp.experts.gate_up_proj" [E, 2I, H], ".down_proj" [E, H, I]
_STACKED_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PARTS = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down")}
# the expert of a per-expert tensor in either naming: "...mlp.experts.3.gate_proj...", "...block_sparse_moe.experts.3.w1..."
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def num_experts_of(config: Any) -> int:
    """The number of routed experts per sparse layer (``num_experts`` or ``num_local_experts``)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


class StackedExperts(nn.Module):
    """The SiLU-gated expert MLPs of one layer this rank holds, as two stacked parameters:
    ``w13 [E_local, 2I, H]`` (each expert's gate rows, then its up rows) and ``w2 [E_local, H, I]``.

    On one device ``E_local = E``. Under tensor parallelism ``I`` is this rank's slice of every
    expert's intermediate size; with ``expert_parallel`` the rank holds ``E / N`` whole experts
    instead and ``expert_map`` turns global expert ids into its local ones (-1: held elsewhere).
    The weight loader fills them one expert projection at a time: part ``(e, "gate")``,
    ``(e, "up")`` or ``(e, "down")`` of global expert ``e`` (see ``sonar_models.weight_loading``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.method = experts_method_for(prefix)
        group = current_group()
        self.group = group
        self.num_experts = num_experts
        self.placement = expert_placement(num_experts, group)
        self.split_intermediate = group.world_size > 1 and not group.expert_parallel
        if self.split_intermediate:
            intermediate_size = group.shard(intermediate_size, "the experts' intermediate size (moe_intermediate_size)")
        self.intermediate_size = intermediate_size  # this rank's
        num_local = self.placement.count
        if self.method is not None:
            self.method.create_weights(self, num_local, hidden_size, intermediate_size)
        else:
            dtype = torch.get_default_dtype()
            self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype))
            self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype))
        self.register_buffer("expert_map", self.placement.expert_map() if self.placement.is_partial else None, persistent=False)

    def checkpoint_parts(self, leaf: str) -> list[tuple[int, str] | tuple[int, str, str]]:
        """The parts the checkpoint fills of parameter ``leaf`` (``"w13"`` or ``"w2"``): those
        of the experts this rank holds, ``(expert, projection)`` for each projection's weight
        and, where the experts method reads more tensors of a projection (scales),
        ``(expert, projection, tensor)`` for each of those."""
        names = ("gate", "up") if leaf == "w13" else ("down",)
        tensors = self.method.checkpoint_tensors if self.method is not None else ("weight",)
        first = self.placement.first
        experts = range(first, first + self.placement.count)
        return [(e, name) if t == "weight" else (e, name, t) for e in experts for name in names for t in tensors]

    def part_rows(self, part: tuple[int, str] | tuple[int, str, str]) -> tuple[int, slice]:
        """The index into ``w13`` or ``w2`` that holds ``part``."""
        expert, name = part[:2]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has {self.num_experts} experts per layer")
        if not self.placement.holds(expert):
            raise ValueError(f"expert {expert} is held by another rank (this one holds {self.placement})")
        size = self.intermediate_size
        rows = {"gate": slice(0, size), "up": slice(size, 2 * size), "down": slice(None)}[name]
        return expert - self.placement.first, rows

    def shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor, part: tuple[int, str]) -> torch.Tensor:
        """This rank's piece of one expert's full projection: with the intermediate size
        split, its rows of gate and of up ``[I, H]`` and its input columns of down ``[H, I]``;
        whole otherwise."""
        if not self.split_intermediate:
            return tensor
        start = self.group.rank * self.intermediate_size
        return tensor.narrow(1 if part[1] == "down" else 0, start, self.intermediate_size)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the experts' weighted sum ``[T, H]``: every expert's slice of
        it (split intermediate), or its own experts' whole products (expert-parallel)."""
        if self.method is not None:
            return self.method.apply(self, x, topk_weights, topk_ids)
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.expert_map)

    def load_checkpoint_part(self, leaf: str, tensor: Any, part: tuple[int, str] | tuple[int, str, str]) -> bool:
        """Hand one tensor of an expert's projection to the experts method, where there is one
        (True: taken; False: the loader copies it into ``w13`` / ``w2``)."""
        if self.method is None:
            return False
        self.method.load_checkpoint_part(self, leaf, tensor, (self.part_rows(part)[0], part[1], part[2] if len(part) > 2 else "weight"))
        return True

    def extra_repr(self) -> str:
        held = f", experts={self.placement.first}..{self.placement.first + self.placement.count - 1}" if self.placement.is_partial else ""
        kept = f"method={type(self.method).__name__}" if self.method is not None else f"w13={tuple(self.w13.shape)}, w2={tuple(self.w2.shape)}"
        return f"num_experts={self.num_experts}{held}, {kept}"


class SparseMoeBlock(nn.Module):
    """Router, top-k selection and experts: ``[T, hidden] -> [T, hidden]``.

    The router's softmax runs in float32 over all experts; the top ``k`` probabilities are
    renormalised to sum to one where ``renormalize`` (Mixtral always, Qwen with
    ``norm_topk_prob``) and rounded to the model's dtype where ``round_weights`` (Qwen).
    A shared expert (Qwen2-MoE), where given, is added, scaled by ``sigmoid(shared_expert_gate(x))``.

    Under tensor parallelism the router and ``shared_expert_gate`` are replicated, the shared
    expert is a sharded ``GatedMLP`` whose partial output is not reduced on its own: routed and
    shared partial sums go through one all-reduce. Expert-parallel, each rank routes its slice
    of the tokens and sends them to the experts' ranks (``sonar_models.expert_parallel``).
    """

    def __init__(
        self,
        config: Any,
        prefix: str,
        intermediate_size: int,
        renormalize: bool,
        round_weights: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        num_experts = num_experts_of(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and the number of experts ({num_experts})")
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.gate = Linear(config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = StackedExperts(num_experts, config.hidden_size, intermediate_size, prefix=f"{prefix}.experts")
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(config, False, f"{prefix}.shared_expert", shared_intermediate_size, reduce_output=False)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
        else:
            self.shared_expert = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k], topk_ids [T, k])`` for ``x [T, hidden]``."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.experts.group
        if self.experts.placement.is_partial:
            # expert-parallel: this rank's tokens to the experts' ranks and back, then in place
            mine = token_slice(x.shape[0], group)
            topk_weights, topk_ids = self.route(x[mine])
            out = torch.zeros_like(x)
            out[mine] = run_experts_across_ranks(
                x[mine], topk_weights, topk_ids, self.experts, self.experts.placement.count, group
            )
        else:
            topk_weights, topk_ids = self.route(x)
            out = self.experts(x, topk_weights, topk_ids)  # a partial sum when the intermediate is split
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # partial under TP
        return group.communicator.all_reduce(out)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-style decoder whose sparse layers run a :class:`SparseMoeBlock`; see the
    subclasses for each architecture's routing and layer pattern."""

    supports_tensor_parallel = True  # the experts' intermediate size split over the ranks, or whole experts per rank
    supports_expert_parallel = True  # enable_expert_parallel: E / N whole experts per rank

    renormalize: bool | None = None  # None: follow config.norm_topk_prob
    round_weights: bool = True

    def is_sparse_layer(self, config: Any, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes to experts (Qwen's rule: not in
        ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer)."""
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        mlp_only = getattr(config, "mlp_only_layers", None) or []
        return layer_idx not in mlp_only and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0

    def expert_sizes(self, config: Any) -> tuple[int, int]:
        """``(expert intermediate size, shared expert intermediate size or 0)``."""
        return int(config.moe_intermediate_size), 0

    def build_mlp(self, config: Any, layer_idx: int, bias: bool) -> nn.Module:
        """A sparse block in the layers that route, the dense MLP (``intermediate_size``) elsewhere."""
        prefix = f"model.layers.{layer_idx}.mlp"
        if not self.is_sparse_layer(config, layer_idx):
            return GatedMLP(config, bias, prefix=prefix)
        intermediate, shared = self.expert_sizes(config)
        renormalize = bool(getattr(config, "norm_topk_prob", False)) if self.renormalize is None else self.renormalize
        return SparseMoeBlock(config, prefix, intermediate, renormalize, self.round_weights, shared)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors, less those of experts another rank holds (expert parallelism)."""
        placement = expert_placement(num_experts_of(self.config), self.group)
        for name, tensor in self._per_expert_tensors(weights):
            index = _EXPERT_INDEX.search(name) if placement.is_partial else None
            expert = -1 if index is None else int(index.group(1))
            if 0 <= expert < placement.num_experts and not placement.holds(expert):
                continue  # another rank's expert (one beyond the config is refused when placed)
            yield name, tensor

    def _per_expert_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert names as they are; transformers' stacked ``gate_up_proj`` / ``down_proj``
        split into per-expert views."""
        for name, tensor in weights:
            stacked = _STACKED_TENSOR.match(name)
            if stacked is None:
                yield name, tensor
                continue
            experts, projection = stacked.group(1), stacked.group(2)
            if tensor.dim() != 3:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; stacked experts are [E, rows, cols]")
            for expert in range(tensor.shape[0]):
                if projection == "down_proj":
                    yield f"{experts}.{expert}.down_proj.weight", tensor[expert]
                else:
                    gate, up = tensor[expert].chunk(2, dim=0)
                    yield f"{experts}.{expert}.gate_proj.weight", gate
                    yield f"{experts}.{expert}.up_proj.weight", up

    def resolve_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """``mlp.experts.{e}.{gate,up,down}_proj.weight`` -> part ``(e, ...)`` of ``w13`` / ``w2``;
        another tensor of the projection (``weight_scale``) -> ``(e, ..., tensor)`` where the
        layer's experts method reads it."""
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return None
        param, part = _PARTS[match.group(3)]
        target, tensor = f"{match.group(1)}.{param}", match.group(4)
        try:
            method = self.get_submodule(match.group(1)).method
        except AttributeError:  # no sparse layer there (a dense layer, another pipeline stage's): refused below
            method = None
        if tensor not in (method.checkpoint_tensors if method is not None else ("weight",)):
            return None  # the loader reports it as a tensor the model has no place for
        return target, (int(match.group(2)), part) if tensor == "weight" else (int(match.group(2)), part, tensor)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k norms); sparse layers route to
    ``num_experts_per_tok`` of ``num_experts`` experts, renormalised with ``norm_topk_prob``;
    ``mlp_only_layers`` and ``decoder_sparse_step`` keep some layers dense."""

    qk_norm = True

    def layer_windows(self, config: Any) -> list[int | None]:
        """``sliding_window`` in every layer where the config keeps one (transformers clears it
        unless ``use_sliding_window``; ``max_window_layers`` plays no part here)."""
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
        return [int(window) if window else None] * config.num_hidden_layers


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: Qwen2's attention (biases on q/k/v); sparse layers add a gated shared
    expert (``shared_expert_intermediate_size``) to the routed ones."""

    o_bias = False

    def __init__(self, hf_config: Any, attention: Any) -> None:
        self.qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        super().__init__(hf_config, attention)

    def expert_sizes(self, config: Any) -> tuple[int, int]:
        return int(config.moe_intermediate_size), int(getattr(config, "shared_expert_intermediate_size", 0) or 0)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's attention (no biases, ``sliding_window`` where set); every layer
    routes to ``num_experts_per_tok`` of ``num_local_experts`` experts (``intermediate_size``
    each), the chosen probabilities always renormalised and kept in float32."""

    qkv_bias = False
    o_bias = False
    renormalize = True
    round_weights = False

    def is_sparse_layer(self, config: Any, layer_idx: int) -> bool:
        return True

    def expert_sizes(self, config: Any) -> tuple[int, int]:
        return int(config.intermediate_size), 0

    def resolve_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2`` are
        the ``mlp.gate`` and ``mlp.experts.{e}.gate/up/down_proj`` of the other layouts."""
        renamed = _mixtral_name(name)
        resolved = super().resolve_checkpoint_name(renamed)
        if resolved is None and renamed != name:
            return renamed, None
        return resolved


def _mixtral_name(name: str) -> str:
    # "model.layers.0.block_sparse_moe.experts.3.w1.weight" -> "model.layers.0.mlp.experts.3.gate_proj.weight"
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.", 1)
    head, _, leaf = name.rpartition(".")
    parent, _, module = head.rpartition(".")
    if module in _MIXTRAL_PROJECTIONS and ".experts." in parent:
        return f"{parent}.{_MIXTRAL_PROJECTIONS[module]}.{leaf}"
    return name
