"""CUDA graphs for decode steps: static input buffers, one captured forward per batch size.

A decode step of ``n`` sequences runs the graph of the smallest captured size ``>= n``; the
rows past ``n`` are padding (slot -1, so nothing is written to the KV cache; a context of one
token, so attention reads one cached key). The model runner fills the static buffers through
pinned host buffers with non-blocking copies; the graph reads them where it was captured.
Without CUDA (tests on CPU) the same buffers run the model eagerly.

With LoRA adapters (a ``LoRABatch``), every size is captured twice: without the LoRA path, for
steps no adapter request is in (they pay nothing for LoRA), and with it, reading the batch's
persistent ``token_slots`` buffer (padding rows -1); a step replays the one its adapters
need. Where the platform has no graph-safe LoRA kernels, adapter steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sonar import ops
from sonar.attention import AttentionMetadata, ForwardContext
from sonar_cuda.attention import TritonStepState
from sonar_cuda.kernels.decode_attention import _num_sms, choose_num_splits

logger = logging.getLogger(__name__)


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 to 256, every 64 to 512,
    every 128 to 1024, every 256 beyond (past 64 rows, padding at most a quarter)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 129, 16)) + list(range(160, 257, 32))
    sizes += list(range(320, 513, 64)) + list(range(640, 1025, 128)) + list(range(1280, max_batch_size + 1, 256))
    sizes = sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})
    return sizes


@dataclass(slots=True, eq=False)
class HostInputs:
    """Pinned host tensors a step's inputs are written into, then copied from: views of one
    buffer laid out as the device's, so a step's inputs go over in one copy."""

    flat: torch.Tensor  # int32: tokens, then seq_lens, then block_tables
    tokens: torch.Tensor  # [3, max_batch] int64: input ids, positions, slots
    seq_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    uploaded: torch.Event | None = None  # recorded after the copy out of them


@dataclass(slots=True)
class DecodeBuffers:
    """Device tensors the graphs read, and two sets of pinned host tensors that feed them.

    The host sets alternate: with asynchronous scheduling a step's inputs are written while
    the copies of the step before may still be queued, so they go to the other set; a set is
    reused only once its previous copies are done."""

    flat: torch.Tensor  # int32 on the device, viewed as the three below (the host sets' layout)
    tokens: torch.Tensor  # [3, max_batch] int64 on the device: input ids, positions, slots
    seq_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one token each)
    logits_indices: torch.Tensor  # [max_batch] int64: 0, 1, 2, ...
    hosts: tuple[HostInputs, HostInputs]
    turn: int = 0

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        pin = device.type == "cuda"

        def host_inputs() -> HostInputs:
            flat = torch.zeros(_flat_size(max_batch, max_blocks), dtype=torch.int32, pin_memory=pin)
            return HostInputs(flat, *_views(flat, max_batch, max_blocks))

        flat = torch.zeros(_flat_size(max_batch, max_blocks), dtype=torch.int32, device=device)
        tokens, seq_lens, block_tables = _views(flat, max_batch, max_blocks)
        seq_lens.fill_(1)
        return cls(
            flat=flat,
            tokens=tokens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(max_batch, dtype=torch.int64, device=device),
            hosts=(host_inputs(), host_inputs()),
        )

    def next_host(self) -> HostInputs:
        """The host set to write the next step's inputs into (its last copies finished)."""
        self.turn ^= 1
        host = self.hosts[self.turn]
        if host.uploaded is not None:
            host.uploaded.synchronize()
        return host

    def upload(self, host: HostInputs, num_rows: int) -> None:
        """Queue ``host``'s inputs to the device (non-blocking), in one copy: the tokens and
        sequence lengths whole, the block tables' first ``num_rows`` rows."""
        end = self.flat.numel() - (self.block_tables.shape[0] - num_rows) * self.block_tables.shape[1]
        self.flat[:end].copy_(host.flat[:end], non_blocking=True)
        if self.tokens.device.type != "cpu":
            host.uploaded = torch.Event(device=self.tokens.device)
            host.uploaded.record()

    def metadata(self, size: int, seq_lens_cpu: list[int], state: TritonStepState) -> AttentionMetadata:
        """Attention metadata over the first ``size`` rows."""
        return AttentionMetadata(
            num_decodes=size,
            num_decode_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.tokens[2, :size],
            max_query_len=1,
            max_seq_len=state.decode_max_seq_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=seq_lens_cpu,
            extra=state,
        )


def _flat_size(max_batch: int, max_blocks: int) -> int:
    return 6 * max_batch + max_batch + max_batch * max_blocks  # int64 tokens count twice


def _views(flat: torch.Tensor, max_batch: int, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [3, max_batch] int64, seq_lens [max_batch], block_tables [max_batch, max_blocks])``
    over the int32 buffer ``flat``."""
    tokens = flat[: 6 * max_batch].view(torch.int64).view(3, max_batch)
    seq_lens = flat[6 * max_batch : 7 * max_batch]
    block_tables = flat[7 * max_batch :].view(max_batch, max_blocks)
    return tokens, seq_lens, block_tables


class DecodeGraphs:
    """One captured decode forward per batch size, over shared :class:`DecodeBuffers`."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        buffers: DecodeBuffers,
        sizes: list[int],
        max_model_len: int,
        use_graphs: bool,
        lora: Any = None,
    ) -> None:
        """``lora``: the model's ``sonar.lora.layers.LoRABatch`` (None: no adapters)."""
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        self.states: dict[int, TritonStepState] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # a drafter's auxiliary hidden states (EAGLE-3, DFlash): the tensor each capture left
        # in the model's ``aux_hidden_states``, refilled by every replay
        self.aux = getattr(model, "aux_hidden_states", None)
        self.aux_outputs: dict[int, torch.Tensor] = {}
        # LoRA: the same per size, captured with the adapter path on (graph-safe kernels only)
        self.lora = lora
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.lora_aux_outputs: dict[int, torch.Tensor] = {}
        device = buffers.tokens.device
        for size in self.sizes:
            num_splits = choose_num_splits(size, model.num_kv_heads, max_model_len, _num_sms(device))
            self.states[size] = TritonStepState(
                num_decodes=size,
                decode_max_seq_len=max_model_len,
                prefill_query_start_loc=buffers.query_start_loc[size:],
                prefill_seq_lens=buffers.seq_lens[size:size],
                prefill_block_tables=buffers.block_tables[size:size],
                prefill_max_query_len=0,
                decode_num_splits=num_splits,
                graph_batch_size=size,
            )

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured batch size holding ``num_seqs`` sequences."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        raise ValueError(f"{num_seqs} sequences exceed the largest decode graph ({self.max_size})")

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        metadata = b.metadata(size, [1] * size, self.states[size])
        return self.model(b.tokens[0, :size], b.tokens[1, :size], ForwardContext(metadata, self.kv_caches))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (no-op without graphs)."""
        if not self.use_graphs:
            return
        started = time.perf_counter()
        b = self.buffers
        b.tokens[2].fill_(-1)  # padding slots: nothing is written while capturing
        b.seq_lens.fill_(1)
        pool = torch.cuda.graph_pool_handle()
        lora = self.lora
        with_lora = [False, True] if lora is not None and lora_graph_safe(lora.token_slots) else [False]
        if lora is not None:
            lora.token_slots.fill_(-1)  # padding rows: no adapter
            lora.capturing = True  # every layer's LoRA path goes into the graphs, filled or not
        for size in reversed(self.sizes):
            for on in with_lora:
                if lora is not None:
                    lora.active = on
                graphs, outputs, aux_outputs = (
                    (self.lora_graphs, self.lora_outputs, self.lora_aux_outputs) if on else (self.graphs, self.outputs, self.aux_outputs)
                )
                self._forward(size)  # warm-up: compiles kernels, builds tables outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs[size] = self._forward(size)
                if self.aux is not None and self.aux.layer_ids:
                    aux_outputs[size] = self.aux.latest
                graphs[size] = graph
        if lora is not None:
            lora.active = lora.capturing = False
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch sizes %s%s) in %.1f s", len(self.graphs) + len(self.lora_graphs), self.sizes,
            ", with and without LoRA" if self.lora_graphs else "", time.perf_counter() - started,
        )

    def run(self, size: int) -> torch.Tensor:
        """The final hidden states ``[size, hidden]`` of the step in the buffers (the LoRA
        graph where the step has adapter requests)."""
        lora_step = self.lora is not None and self.lora.active
        graphs, outputs, aux_outputs = (
            (self.lora_graphs, self.lora_outputs, self.lora_aux_outputs) if lora_step else (self.graphs, self.outputs, self.aux_outputs)
        )
        graph = graphs.get(size)
        if graph is None:
            return self._forward(size)
        graph.replay()
        if size in aux_outputs:
            self.aux.latest = aux_outputs[size]
        return outputs[size]


class GraphedModel(torch.nn.Module):
    """The model, with decode steps that the runner laid out in the static buffers replayed
    from their graph; every other step runs eagerly."""

    def __init__(self, model: torch.nn.Module, graphs: DecodeGraphs) -> None:
        super().__init__()
        self.model = model
        self.graphs = graphs
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, intermediate: Any = None
    ) -> Any:
        if intermediate is not None:  # a later pipeline stage (graphs are off under pipeline parallelism)
            return self.model(input_ids, positions, ctx, intermediate)
        state = ctx.attn_metadata.extra if ctx.attn_metadata is not None else None
        size = state.graph_batch_size if isinstance(state, TritonStepState) else 0
        if size:
            if ctx.kv_connector is not None:  # the step's loads land whole before the replay
                for layer_idx in range(len(ctx.kv_caches)):
                    ctx.kv_connector.wait_for_layer_load(layer_idx)
            hidden = self.graphs.run(size)
            num_rows = input_ids.shape[0]
            aux = self.graphs.aux
            if aux is not None and aux.latest is not None and aux.latest.shape[0] != num_rows:
                aux.latest = aux.latest[:num_rows]
            return hidden[:num_rows]
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


def lora_graph_safe(tensor: torch.Tensor) -> bool:
    """Whether the platform runs both LoRA operations with kernels on ``tensor``'s device
    (they never read ``token_slots`` on the host; the torch versions do, so cannot be
    captured)."""
    return ops.platform_op(tensor, "lora_shrink") is not None and ops.platform_op(tensor, "lora_expand") is not None


def fill_padding(host: HostInputs, num_rows: int) -> None:
    """Every row from ``num_rows`` on becomes padding (the step's graph reads up to its
    size; the rest never keeps a stale placeholder token that a larger graph could read)."""
    tokens = host.tokens.numpy()
    tokens[:2, num_rows:] = 0
    tokens[2, num_rows:] = -1
    host.seq_lens.numpy()[num_rows:] = 1
