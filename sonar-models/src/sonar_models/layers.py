"""Small building blocks shared by the decoder models."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sonar import ops
from sonar.distributed import ParallelGroup, current_group
from sonar.quantization import fp8, linear_method_for

PARALLEL_MODES = ("replicated", "column", "row")


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Hugging Face does).

    Runs through ``sonar.ops``, so a platform's fused kernel replaces it where registered.

    ``feeds`` names the one linear layer that alone reads the norm's output, where the model
    knows it (a decoder layer's q/k/v and gate/up projections). When that layer's method takes
    its input prepared in a form the norm's kernel can also emit (FP8 rows: the output
    quantized per token, ``LinearMethod.takes_prepared_input``) and the platform has that
    kernel, the norm emits it and hands it to the layer, which then skips its own pass.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.feeds: tuple[Linear, ...] = ()  # a tuple, so the layer is not registered as a child
        self._consumers: tuple[Linear, ...] | None = None  # those of ``feeds`` that take FP8 rows; None: not looked up yet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        consumer = self._fp8_consumer()
        if consumer is not None:
            fused = fp8.rms_norm_fp8_rows(x, self.weight, self.eps)
            if fused is not None:
                consumer.hand_prepared_input(*fused)
                return fused[0]
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual``; returns ``(norm(residual), residual)`` (may reuse the inputs' memory)."""
        consumer = self._fp8_consumer()
        if consumer is not None:
            fused = fp8.fused_add_rms_norm_fp8_rows(x, residual, self.weight, self.eps)
            if fused is not None:
                normed, residual, rows = fused
                consumer.hand_prepared_input(normed, rows)
                return normed, residual
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def _fp8_consumer(self) -> Linear | None:
        """The fed layer that takes FP8 rows, looked up at the first call (the model is built
        and its adapters attached by then)."""
        if self._consumers is None:
            self._consumers = tuple(
                layer for layer in self.feeds if layer.lora is None and layer.linear_method.takes_prepared_input(layer) == "fp8_rows"
            )
        return self._consumers[0] if self._consumers else None


class Linear(nn.Module):
    """A linear layer run by the ``sonar.quantization.LinearMethod`` it holds.

    Unquantized (the default outside a quantized build), it has ``nn.Linear``'s parameters and
    state-dict names and runs through ``sonar.ops.linear``, so a platform's kernel serves the
    shapes it does better. ``prefix`` is the layer's checkpoint module name
    (``model.layers.0.mlp.down_proj``): a quantization method may treat layers differently.

    ``parallel`` says how it shards over the tensor-parallel group it is built for
    (``sonar.distributed.current_group``): ``"replicated"`` (every rank the whole layer),
    ``"column"`` (each rank its slice of the output rows; the caller gets a slice of the output)
    or ``"row"`` (each rank its slice of the input columns; the partial outputs are summed by
    one all-reduce). Checkpoint tensors are full-sized; ``shard_checkpoint_tensor`` cuts this
    rank's piece (the method knows how its quantized tensors split) before the method loads it.

    ``lora`` is set on the layers of a model built with LoRA enabled (``sonar.lora.layers``):
    the base output, whatever the method, gets each adapter token's delta added.
    """

    lora = None  # a sonar.lora.layers.LoRALinear once adapters are attached
    reduce_output = True  # row-parallel: all-reduce in forward (False: the caller sums the partial outputs)
    _prepared: tuple[torch.Tensor, Any] | None = None  # (the input it was made from, the prepared form)

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, prefix: str = "", parallel: str = "replicated",
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self._build(in_features, {"": out_features}, bias, prefix, parallel, {})
        self.reduce_output = reduce_output

    def _build(
        self, in_features: int, parts: dict[str, int], bias: bool, prefix: str, parallel: str,
        shards: dict[str, tuple[int, int]],
    ) -> None:
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={parallel!r} is not one of {PARALLEL_MODES}")
        group = current_group()
        self.group: ParallelGroup = group
        self.parallel = parallel if group.world_size > 1 else "replicated"
        self.prefix = prefix
        # column: part -> (this rank's shard index, number of shards); a part cut into fewer
        # shards than ranks is replicated over the ranks that share a shard (KV heads)
        self.shards = {name: shards.get(name, (group.rank, group.world_size)) for name in parts}
        local_parts = dict(parts)
        if self.parallel == "column":
            local_parts = {name: -(-size // self.shards[name][1]) for name, size in parts.items()}
        elif self.parallel == "row":
            in_features = group.shard(in_features, f"{prefix} input features")
        self.checkpoint_sizes = dict(parts)  # each part's rows in the checkpoint
        self.local_parts = local_parts
        self.in_features = in_features
        self.out_features = sum(local_parts.values())
        self.linear_method = linear_method_for(prefix)
        if self.parallel != "replicated" and not self.linear_method.supports_tensor_parallel:
            raise ValueError(
                f"{prefix}: {type(self.linear_method).__name__} layers do not shard for tensor parallelism; "
                f"serve this checkpoint with tensor_parallel_size=1"
            )
        self.linear_method.create_weights(self, in_features, list(local_parts.values()), bias, torch.get_default_dtype())

    def shard_checkpoint_tensor(self, param_name: str, tensor: Any, part: str | None) -> Any:
        """This rank's piece of the full checkpoint tensor filling ``param_name`` (of fused
        part ``part``), cut by the layer's ``LinearMethod`` (``sonar.quantization.sharding``):
        rows for a column-parallel layer (zero-padded where the rows do not divide, as a
        vocabulary), input columns for a row-parallel one, whose bias rank 0 alone adds."""
        if self.parallel == "replicated":
            return tensor
        return self.linear_method.shard_checkpoint_tensor(self, param_name, tensor, part)

    def hand_prepared_input(self, x: torch.Tensor, prepared: Any) -> None:
        """``x`` in the form the method's ``takes_prepared_input`` names, made by the producer
        of ``x`` (the norm before the layer); the next call on that very tensor uses it."""
        self._prepared = (x, prepared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepared = None
        if self._prepared is not None:  # taken once, and only for the very tensor it was made from
            made_from, prepared = self._prepared
            self._prepared = None
            if made_from is not x or self.lora is not None:
                prepared = None
        if prepared is not None:
            out = self.linear_method.apply(self, x, prepared)
        else:
            out = self.linear_method.apply(self, x) if self.lora is None else self.lora.apply(self, x)
        if self.parallel == "row" and self.reduce_output:
            out = self.group.communicator.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"method={type(self.linear_method).__name__}, parallel={self.parallel}"
        )


class MergedLinear(Linear):
    """A Linear whose output rows are several checkpoint projections stacked in order
    (``{"q": 576, "k": 192, "v": 192}``); the weight loader fills each part separately.

    Column-parallel, each rank holds its slice of every part, in the same order; ``shards``
    gives a part its own ``(shard index, number of shards)`` where it splits into fewer pieces
    than ranks (KV heads when there are fewer of them than ranks). ``parts`` are this rank's
    sizes."""

    def __init__(
        self, in_features: int, parts: dict[str, int], bias: bool, prefix: str = "", parallel: str = "replicated",
        shards: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self._build(in_features, dict(parts), bias, prefix, parallel, shards or {})
        self.parts = dict(self.local_parts)

    def part_rows(self, part: str) -> slice:
        """The output rows that hold ``part``."""
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(f"{part!r} is not one of this layer's parts {list(self.parts)}")


class VocabParallelEmbedding(nn.Embedding):
    """A token embedding whose vocabulary rows are split over the tensor-parallel group: each
    rank holds ``ceil(vocab / ranks)`` rows (the last zero-padded), looks up the tokens that
    fall in them, and one all-reduce sums the ranks' rows. On one rank it is ``nn.Embedding``."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        group = current_group()
        self.group = group
        self.vocab_size = num_embeddings
        self.rows_per_rank = -(-num_embeddings // group.world_size)
        self.first_row = group.rank * self.rows_per_rank
        super().__init__(self.rows_per_rank if group.world_size > 1 else num_embeddings, embedding_dim)

    def shard_checkpoint_tensor(self, param_name: str, tensor: torch.Tensor, part: str | None) -> torch.Tensor:
        """This rank's rows of the full ``[vocab, hidden]`` checkpoint tensor (zero-padded)."""
        if self.group.world_size == 1:
            return tensor
        rows = self.rows_per_rank * self.group.world_size
        if tensor.shape[0] < rows:
            tensor = torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])
        return tensor.narrow(0, self.first_row, self.rows_per_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = super().forward(local.masked_fill(outside, 0))  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.communicator.all_reduce(out)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over a fused ``[..., 2 * intermediate]`` input (through ``sonar.ops``)."""
    return ops.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` with the tanh approximation (``gelu_pytorch_tanh``, Gemma's GeGLU),
    over a fused ``[..., 2 * intermediate]`` input, in the input's dtype as transformers does."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


#: the gated activations a config's ``hidden_act`` / ``hidden_activation`` may name
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul}
