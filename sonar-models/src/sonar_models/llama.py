"""Llama-family decoders: Llama (1-3, SmolLM2), Mistral, Qwen2 and Qwen3.

One plain-PyTorch implementation; the four differ only in where projections carry biases and
whether queries and keys are RMS-normed per head (Qwen3). Tokens arrive as one flat batch
(sequences concatenated, no batch dimension); attention over the paged KV cache is done by the
layer the engine's ``AttentionFactory`` builds.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from sonar import ops
from sonar.attention import ForwardContext
from sonar.distributed import ParallelGroup, current_group
from sonar.engine.kv_cache_spec import KVCacheSpec
from sonar.engine.model_source import stretched_context
from sonar.model_interface import AttentionFactory, kv_cache_spec_for
from sonar.pipeline import WHOLE_MODEL, IntermediateTensors, PipelineStage, current_stage
from sonar_models.aux_hidden_states import AuxHiddenStates
from sonar_models.kv_scales import KVScaleCollector
from sonar_models.layers import GATED_ACTIVATIONS, Linear, MergedLinear, RMSNorm, VocabParallelEmbedding
from sonar_models.rope import RotaryEmbedding, rope_spec_from_config
from sonar_models.weight_loading import FusedProjection, load_hf_weights

FUSED_PROJECTIONS = (
    FusedProjection("q_proj", "qkv_proj", "q"),
    FusedProjection("k_proj", "qkv_proj", "k"),
    FusedProjection("v_proj", "qkv_proj", "v"),
    FusedProjection("gate_proj", "gate_up_proj", "gate"),
    FusedProjection("up_proj", "gate_up_proj", "up"),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@functools.lru_cache(maxsize=None)
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a Python float: multiplies as a tensor of that dtype
    would, without a tensor (a host-to-device copy would break graph capture); once per value
    and dtype, not per step."""
    return float(torch.tensor(value, dtype=dtype, device="cpu"))


def head_dim_of(config: Any) -> int:
    """The per-head size: explicit ``head_dim`` where the config has one (Qwen3), else
    ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows_of(config: Any) -> list[int | None]:
    """Each layer's attention window (None: full attention), as transformers decides it.

    Mistral: ``sliding_window`` in every layer. Qwen2/Qwen3: only with ``use_sliding_window``,
    and then in the layers that ``layer_types`` marks ``"sliding_attention"``; where a config
    has no ``layer_types``, in layers ``max_window_layers`` and up (transformers builds
    ``layer_types`` that way from ``max_window_layers``).
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return [int(window) if kind == "sliding_attention" else None for kind in layer_types]
    first_sliding = getattr(config, "max_window_layers", None)
    if first_sliding is None or getattr(config, "model_type", "") == "mistral":
        first_sliding = 0
    return [int(window) if i >= first_sliding else None for i in range(num_layers)]


def kv_heads_of(num_kv_heads: int, group: ParallelGroup) -> tuple[int, tuple[int, int]]:
    """This rank's KV heads and its ``(shard index, number of shards)`` of the k/v rows: split
    over the ranks where there are at least as many heads as ranks, else one head per rank,
    each head replicated over ``ranks / heads`` ranks."""
    ranks = group.world_size
    if num_kv_heads >= ranks:
        return group.shard(num_kv_heads, "num_key_value_heads"), (group.rank, ranks)
    if ranks % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={ranks} is neither a divisor nor a multiple of num_key_value_heads={num_kv_heads}"
        )
    return 1, (group.rank // (ranks // num_kv_heads), num_kv_heads)


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        attention: AttentionFactory,
        layer_idx: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None = None,
        cache_index: int | None = None,
        scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        group = current_group()
        self.num_heads = group.shard(config.num_attention_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads, kv_shard = kv_heads_of(config.num_key_value_heads, group)
        self.head_dim = head_dim_of(config)
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        parts = {"q": q_size, "k": kv_size, "v": kv_size}
        self.qkv_proj = MergedLinear(
            config.hidden_size, parts, bias=qkv_bias, prefix=f"{prefix}.qkv_proj", parallel="column",
            shards={"k": kv_shard, "v": kv_shard},
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias, prefix=f"{prefix}.o_proj", parallel="row")
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.sliding_window = sliding_window
        # cache_index: which of the worker's KV caches is this layer's (its stage's own count)
        self.attn = attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale or self.head_dim**-0.5,
            layer_idx if cache_index is None else cache_index, sliding_window=sliding_window,
            logit_softcap=None if logit_softcap is None else float(logit_softcap),
        )

    def forward(self, x: torch.Tensor, rope: Any, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.parts.values()), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.apply_rotary(q, k, rope)
        out = self.attn(q, k, v, ctx)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (``act`` the config's: SiLU, or Gemma's tanh GELU); under tensor parallelism gate/up are column-parallel and
    down row-parallel, its partial outputs all-reduced unless ``reduce_output`` is False (the
    caller then sums them, together with its own: a shared expert)."""

    def __init__(
        self, config: Any, bias: bool, prefix: str = "", intermediate_size: int | None = None, reduce_output: bool = True
    ) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in GATED_ACTIVATIONS:
            raise NotImplementedError(f"hidden_act={activation!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": size, "up": size}, bias=bias, prefix=f"{prefix}.gate_up_proj", parallel="column"
        )
        self.down_proj = Linear(
            size, config.hidden_size, bias=bias, prefix=f"{prefix}.down_proj", parallel="row", reduce_output=reduce_output
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, attn: DecoderAttention, mlp: GatedMLP, config: Any) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # each norm's output is read by one projection alone (a mixture of experts reads it otherwise)
        self.input_layernorm.feeds = (attn.qkv_proj,)
        gate_up = getattr(mlp, "gate_up_proj", None)
        self.post_attention_layernorm.feeds = (gate_up,) if isinstance(gate_up, Linear) else ()

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Any, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in and out: the residual add is fused into the next norm, so
        the layer's output is ``hidden + residual``."""
        # attention block
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, ctx)
        # mlp block
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class StageMissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no parameters, never run."""


class DecoderModel(nn.Module):
    """The embedding, the decoder layers and the final norm; under pipeline parallelism only
    ``stage``'s layers are built (the others are ``StageMissingLayer``, so names keep their
    global layer index), the embedding on the first stage and the norm on the last."""

    embed_scale: float | None = None  # the embedding's output times this, rounded to its dtype (Gemma)

    def __init__(
        self, layers: list[nn.Module], config: Any, head_dim: int, stage: PipelineStage = WHOLE_MODEL,
        layer_rope_types: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.layer_range = stage.layer_range(len(layers))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.is_first else None
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        spec = rope_spec_from_config(config, head_dim)
        max_position = stretched_context(spec.max_position_embeddings, spec.scaling)
        # one rotary for every layer, or one per layer type where layers rotate differently
        # (Gemma 3: local and global layers)
        self.layer_rope_types = layer_rope_types
        self.rotary_emb = RotaryEmbedding(spec, max_position) if layer_rope_types is None else None
        self.rotary_by_type = {
            kind: RotaryEmbedding(rope_spec_from_config(config, head_dim, kind), max_position)
            for kind in sorted(set(layer_rope_types or ()))
        }
        self.aux_hidden_states = AuxHiddenStates(len(layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
            if self.embed_scale is not None:
                hidden = hidden * rounded_to(self.embed_scale, hidden.dtype)
        else:  # a later pipeline stage: the previous stage's output
            hidden, residual = intermediate.hidden, intermediate.residual
        if self.layer_rope_types is None:
            rope = ops.rotary_tables(self.rotary_emb, positions, hidden.dtype)  # once per step
            ropes = None
        else:  # once per step and layer type
            by_type = {kind: ops.rotary_tables(r, positions, hidden.dtype) for kind, r in self.rotary_by_type.items()}
            ropes = [by_type[kind] for kind in self.layer_rope_types]
        aux, captured = self.aux_hidden_states, []  # aux layers: none unless a drafter asked (EAGLE-3)
        layers = self.layers
        for i in self.layer_range:
            if i in aux.layer_ids:
                captured.append(aux.layer_input(hidden, residual))
            hidden, residual = layers[i](hidden, residual, rope if ropes is None else ropes[i], ctx)
        if captured:
            aux.latest = torch.cat(captured, dim=-1)  # [T, len(layer_ids) * hidden]
        if self.norm is None:  # not the last stage: hand on
            return IntermediateTensors(hidden, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-style causal LM following ``sonar.model_interface``.

    :param hf_config: the model's ``transformers`` config (``LlamaConfig`` or a sibling).
    :param attention: builds each layer's paged attention,
        ``attention(num_heads, num_kv_heads, head_dim, scale, layer_idx)``.

    ``forward(input_ids [T], positions [T], ctx)`` returns final hidden states ``[T, hidden]``;
    ``compute_logits`` turns (selected) hidden states into float32 logits. Weights are loaded
    with ``load_weights`` from Hugging Face names; q/k/v and gate/up go into fused projections.
    """

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm: bool = False
    fused_projections = FUSED_PROJECTIONS  # where each checkpoint projection sits (LoRA adapters name those)
    supports_tensor_parallel = True  # shards over a tensor-parallel group (sonar.distributed)
    supports_pipeline_parallel = True  # builds one stage's layers (sonar.pipeline)

    def __init__(self, hf_config: Any, attention: AttentionFactory) -> None:
        super().__init__()
        config = hf_config
        self.config = config
        group = current_group()
        if group.world_size > 1 and not self.supports_tensor_parallel:
            raise ValueError(f"{type(self).__name__} does not run with tensor parallelism yet; use tensor_parallel_size=1")
        self.group: ParallelGroup = group
        self.stage = stage = current_stage()
        layer_ids = stage.layer_range(config.num_hidden_layers)
        self.num_layers = len(layer_ids)  # this stage's layers: the ones the worker caches KV for
        self.num_kv_heads = kv_heads_of(config.num_key_value_heads, group)[0]  # this rank's
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.sliding_windows = self.layer_windows(config)
        layers = [
            self.build_layer(
                config,
                DecoderAttention(
                    config, attention, i, qkv_bias, o_bias, self.qk_norm, self.sliding_windows[i], cache_index=i - layer_ids.start,
                    scale=self.attention_scale(config), logit_softcap=getattr(config, "attn_logit_softcapping", None) or None,
                ),
                self.build_mlp(config, i, mlp_bias),
            )
            if i in layer_ids else StageMissingLayer()
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(layers, config, self.head_dim, stage, self.layer_rope_types(config))
        # vocabulary-parallel: each rank its rows (padded to divide), the logits gathered
        self.lm_head = None  # on the last pipeline stage only
        if stage.is_last:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, prefix="lm_head", parallel="column")
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and stage.is_single:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.aux_hidden_states = self.model.aux_hidden_states  # see sonar_models.aux_hidden_states

    def build_layer(self, config: Any, attn: DecoderAttention, mlp: nn.Module) -> nn.Module:
        """One decoder layer around its attention and feed-forward blocks (pre-norm, as Llama)."""
        return DecoderLayer(attn, mlp, config)

    def attention_scale(self, config: Any) -> float | None:
        """The attention's score scale (None: ``head_dim ** -0.5``)."""
        return None

    def layer_rope_types(self, config: Any) -> list[str] | None:
        """Each layer's rotary parameter set where layers rotate differently (None: one set)."""
        return None

    def layer_windows(self, config: Any) -> list[int | None]:
        """Each layer's attention window (None: full attention); see ``sliding_windows_of``."""
        return sliding_windows_of(config)

    def build_mlp(self, config: Any, layer_idx: int, bias: bool) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block, ``[T, hidden] -> [T, hidden]``, named
        ``model.layers.{layer_idx}.mlp`` (a SiLU-gated MLP here; mixture-of-experts models
        override it)."""
        return GatedMLP(config, bias, prefix=f"model.layers.{layer_idx}.mlp")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states ``[T, hidden]`` for a flat batch of tokens at absolute ``positions``.

        Under pipeline parallelism a stage after the first starts from ``intermediate`` (the
        previous stage's output) instead of ``input_ids``, and a stage before the last returns
        its ``IntermediateTensors`` instead."""
        return self.model(input_ids, positions, ctx, intermediate)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer of this stage (every layer, without pipeline parallelism): a
        sliding window where the config gives that layer one, else full attention."""
        layer_ids = self.model.layer_range
        return [kv_cache_spec_for(window) for window in self.sliding_windows[layer_ids.start : layer_ids.stop]]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]`` (gathered from every rank's
        vocabulary rows under tensor parallelism)."""
        logits = self.lm_head(hidden_states)
        if self.group.world_size > 1:
            logits = self.group.communicator.all_gather(logits, dim=-1)[:, : self.vocab_size]
        cap = self.final_logit_softcapping
        if cap:  # Gemma's tanh cap on the logits
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (``model.layers.0.self_attn.q_proj.weight``, ...).

        KV-cache scales (``self_attn.k_scale`` / ``v_scale`` / ``kv_scale``), where present, go
        to the layers' attention (see ``sonar_models.kv_scales``). Raises ``ValueError`` on an
        unknown name, a shape mismatch or a parameter left unfilled.
        """
        stage = self.stage
        if self.tie_word_embeddings and stage.is_single:
            self.lm_head.weight = self.model.embed_tokens.weight  # re-tie after e.g. to_empty()
        skipped = frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()
        weights = self.checkpoint_tensors(weights)
        if not stage.is_single:
            weights, skipped = self._stage_tensors(weights), frozenset()
        kv_scales = KVScaleCollector()
        weights = kv_scales.without_scales(weights)
        load_hf_weights(self, weights, FUSED_PROJECTIONS, IGNORED_SUFFIXES, skipped, self.resolve_checkpoint_name)
        kv_scales.apply(self)

    def _stage_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors this pipeline stage holds: its layers', the embedding on the
        first stage, the final norm and LM head on the last (where the head is tied to the
        embedding and the last stage is not the first, the embedding fills the head)."""
        stage, layer_ids = self.stage, self.model.layer_range
        head_from_embedding = self.tie_word_embeddings and not stage.is_first
        for name, tensor in weights:
            if name.startswith("model.layers."):
                if int(name.split(".", 3)[2]) not in layer_ids:
                    continue
            elif name.startswith("model.embed_tokens."):
                if head_from_embedding and stage.is_last:
                    name = "lm_head." + name.removeprefix("model.embed_tokens.")
                elif not stage.is_first:
                    continue
            elif name.startswith("model.norm."):
                if not stage.is_last:
                    continue
            elif name.startswith("lm_head."):
                if not stage.is_last or (self.tie_word_embeddings and name == "lm_head.weight"):
                    continue  # tied: the head's weight is filled from the embedding (a quantized table it keeps stays)
            yield name, tensor

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as ``load_weights`` reads them: unchanged here; a subclass
        renames or splits the layouts it accepts (stacked experts, say)."""
        return weights

    def resolve_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """``(parameter name, part)`` for a checkpoint name this class places itself, None to
        leave it to the fused-projection rules (always None here)."""
        return None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout without biases, with sliding-window attention where the config
    sets ``sliding_window``."""

    qkv_bias = False
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v (never on o_proj).

    With ``use_sliding_window``, the layers from ``max_window_layers`` on slide (see
    ``sliding_windows_of``)."""

    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on queries and keys before rotary, explicit ``head_dim``."""

    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4-mini: Llama's layer with the projections fused in the checkpoint
    (``qkv_proj`` rows q, k, v; ``gate_up_proj`` rows gate, up), no biases, LongRoPE scaling
    and a partial rotary dimension where the config sets them, and a sliding window in every
    layer where it sets ``sliding_window``."""

    qkv_bias = False
    o_bias = False
    # a LoRA adapter trained on Phi-3 names the fused modules; its weights split like the checkpoint's
    lora_fused_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused checkpoint projections split into the parts Llama's names give them
        (``qkv_proj.weight`` -> ``q_proj/k_proj/v_proj.weight``), so tensor parallelism and
        LoRA see one layout; only floating-point projections split (a quantized Phi-3
        checkpoint is refused by name)."""
        config = self.config
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        splits = {
            "self_attn.qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "mlp.gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
        }
        for name, tensor in weights:
            module_path, _, leaf = name.rpartition(".")
            owner, _, fused = module_path.rpartition(".")
            parts = splits.get(f"{owner.rpartition('.')[2]}.{fused}")
            if parts is None:
                yield name, tensor
                continue
            if leaf != "weight" or not tensor.is_floating_point():
                raise ValueError(f"checkpoint tensor {name!r}: Sonar splits Phi-3's fused projections only from floating-point weights")
            sizes = [size for _, size in parts]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config gives {sum(sizes)} (does config.json match the weights?)")
            parent = owner.rpartition(".")[0]
            for (part_name, _), piece in zip(parts, tensor.split(sizes, dim=0)):
                yield f"{parent}.{owner.rpartition('.')[2]}.{part_name}.{leaf}", piece

