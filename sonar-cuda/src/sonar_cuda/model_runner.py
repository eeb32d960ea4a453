"""The CUDA model runner: decode steps through CUDA graphs, inputs through pinned memory.

Decode-only steps (every scheduled request adds its one sampled token) are laid out straight
into the graphs' static buffers: each running request keeps a row of a host block table,
updated only with its new blocks, and a step gathers the rows it needs, computes slots and
positions with numpy, and queues three non-blocking copies. The step's only host
synchronisation is reading the sampled token ids, after the next step is launched. Any other
step (prefill, chunked prefill, prompt logprobs, a batch larger than the largest graph) takes
the core runner's eager path.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from sonar.attention import AttentionMetadata
from sonar.engine.scheduler_output import SchedulerOutput
from sonar.worker.input_batch import CachedRequestState, StepBatch
from sonar.worker.model_runner import ModelRunner
from sonar_cuda.decode_graphs import DecodeBuffers, DecodeGraphs, GraphedModel, default_capture_sizes, fill_padding
from sonar_cuda.kernels.decode_attention import warm_up_decode_attention

logger = logging.getLogger(__name__)

DUMMY_INIT_STD = 0.02


class CudaModelRunner(ModelRunner):
    """The core model runner plus CUDA graphs for decode steps.

    ``max_graph_batch_size`` bounds the captured sizes; ``SONAR_ENFORCE_EAGER=1`` turns graphs
    off (the static-buffer decode path still runs, eagerly). On a CPU device (tests through
    Triton's interpreter) the same path runs without graphs.
    """

    max_graph_batch_size: int = 256

    def __init__(self, model_config, block_size: int, device: torch.device, attention_backend_cls: str) -> None:
        super().__init__(model_config, block_size, device, attention_backend_cls)
        self.use_graphs = device.type == "cuda" and os.environ.get("SONAR_ENFORCE_EAGER", "") not in ("1", "true")
        self.max_blocks_per_seq = -(-model_config.max_model_len // block_size) + 1
        self.graphs: DecodeGraphs | None = None
        # host block table: one persistent row per running request
        self._table_rows = np.zeros((0, self.max_blocks_per_seq), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._blocks_in_row: dict[str, int] = {}
        self._free_rows: list[int] = []

    # -- setup ---------------------------------------------------------------------------

    def load_model(self) -> None:
        """As the core runner, except ``load_format="dummy"`` draws the random weights on the
        device (norm weights 1, biases 0, the rest normal(0, 0.02)) instead of streaming them
        from host memory."""
        config = self.model_config
        if config.load_format != "dummy":
            super().load_model()
            return
        started = time.perf_counter()
        model = self.build_model()
        generator = torch.Generator(device=self.device).manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1 and "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, DUMMY_INIT_STD, generator=generator)
        self.model = model.eval()
        logger.info("built %s with random weights in %.1f s", type(model).__name__, time.perf_counter() - started)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then the decode buffers and graphs over it."""
        super().init_kv_cache(num_blocks)
        model = self.model.model if isinstance(self.model, GraphedModel) else self.model
        max_batch = self.max_graph_batch_size
        buffers = DecodeBuffers.allocate(max_batch, self.max_blocks_per_seq, self.device)
        self.graphs = DecodeGraphs(
            model, self.kv_caches, buffers, default_capture_sizes(max_batch), self.model_config.max_model_len, self.use_graphs
        )
        self.graphs.capture()
        self.model = GraphedModel(model, self.graphs)
        if self.device.type == "cuda":  # compile the eager decode path's split-KV variants now
            kv = self.kv_caches[0]
            num_heads = self.model_config.hf_config.num_attention_heads
            warm_up_decode_attention(kv[0], kv[1], num_heads, self.model_config.dtype)

    # -- request state: persistent block-table rows ---------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        super()._update_states(so)
        for req_id in so.finished_req_ids:
            row = self._row_of.pop(req_id, None)
            if row is not None:
                self._free_rows.append(row)
                self._blocks_in_row.pop(req_id, None)
        for new in so.new_reqs:
            self._write_blocks(new.req_id, new.block_ids, restart=True)
        for cached in so.cached_reqs:
            if cached.new_block_ids:
                self._write_blocks(cached.req_id, cached.new_block_ids, restart=False)

    def _write_blocks(self, req_id: str, block_ids: list[int], restart: bool) -> None:
        row = self._row_of.get(req_id)
        if row is None:
            if not self._free_rows:
                self._grow_table()
            row = self._row_of[req_id] = self._free_rows.pop()
            restart = True
        start = 0 if restart else self._blocks_in_row[req_id]
        end = start + len(block_ids)
        self._table_rows[row, start:end] = block_ids
        self._blocks_in_row[req_id] = end

    def _grow_table(self) -> None:
        old = len(self._table_rows)
        new = max(2 * old, 64)
        grown = np.zeros((new, self.max_blocks_per_seq), dtype=np.int32)
        grown[:old] = self._table_rows
        self._table_rows = grown
        self._free_rows.extend(range(new - 1, old - 1, -1))

    # -- one step ------------------------------------------------------------------------

    def _is_plain_decode(self, states: list[CachedRequestState], num_scheduled: list[int]) -> bool:
        if self.graphs is None or not states or len(states) > self.graphs.max_size:
            return False
        for state, n in zip(states, num_scheduled):
            if n != 1 or state.num_computed_tokens + 1 != state.num_tokens:
                return False
            if state.sampling.params.prompt_logprobs is not None and state.num_computed_tokens < len(state.prompt_token_ids):
                return False
        return True

    def build_batch(self, states: list[CachedRequestState], num_scheduled: list[int]) -> StepBatch:
        """Decode-only steps go into the graphs' static buffers; others to the core builder."""
        if not self._is_plain_decode(states, num_scheduled):
            return super().build_batch(states, num_scheduled)
        graphs = self.graphs
        buffers = graphs.buffers
        n = len(states)
        size = graphs.size_for(n)

        # host side: rows of the block table, positions, slots, last tokens (a token still
        # being sampled by the step before is a placeholder here, fed on the device)
        host = buffers.next_host()
        tables = host.block_tables.numpy()
        rows = np.fromiter((self._row_of[s.req_id] for s in states), dtype=np.int64, count=n)
        np.take(self._table_rows, rows, axis=0, out=tables[:n])
        positions = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=n)
        tokens = host.tokens.numpy()
        tokens[0, :n] = [_last_token(s) for s in states]
        tokens[1, :n] = positions
        block_size = self.block_size
        tokens[2, :n] = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
        seq_lens = positions + 1
        host.seq_lens.numpy()[:n] = seq_lens
        fill_padding(host, n)

        # device side: three non-blocking copies from pinned memory
        buffers.upload(host, n)
        state = graphs.states[size]
        metadata: AttentionMetadata = buffers.metadata(size, seq_lens.tolist(), state)
        return StepBatch(
            states=list(states),
            num_scheduled=[1] * n,
            input_ids=buffers.tokens[0, :n],
            positions=buffers.tokens[1, :n],
            attn_metadata=metadata,
            sample_rows=list(range(n)),
            logits_indices=buffers.logits_indices[:n],
        )


def _last_token(state: CachedRequestState) -> int:
    """The token a decode step feeds: the one at position ``num_computed_tokens``."""
    position = state.num_computed_tokens
    prompt = state.prompt_token_ids
    if position < len(prompt):
        return prompt[position]
    return state.sampling.output_token_ids[position - len(prompt)]

