"""The CUDA model runner: decode steps through CUDA graphs, inputs through pinned memory.

Decode-only steps (every scheduled request adds its one sampled token) are laid out straight
into the graphs' static buffers: a step gathers its requests' rows of the core runner's
persistent host block table, computes slots and
positions with numpy, and queues three non-blocking copies. The step's only host
synchronisation is reading the sampled token ids, after the next step is launched. Verify
steps of speculative decoding run in the same graphs, one row per token, and so do prompts
(or chunks of them) of up to ``prompt_chunk_limit`` tokens: each row attends up to its own
position, which is a prefill's causal attention. Any other step (longer prompts, prompt
logprobs, proposers that read the target's hidden states, adapters, more rows than the largest
graph) takes the core runner's eager path.

With LoRA, a step's adapter slots are written into the persistent ``token_slots`` buffer the
graphs read (by the core runner's ``launch``, after the batch is built); decode steps with
adapter requests replay graphs captured with the LoRA path, the others graphs without it.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from sonar import ops
from sonar.attention import AttentionMetadata
from sonar.sampler.metadata import SamplingMetadata
from sonar.spec_decode.device_passes import PassChain, PassRows
from sonar.spec_decode.interface import DraftCacheBudget
from sonar.spec_decode.worker_side import ChainedProposal
from sonar.tensors import to_device
from sonar.worker.input_batch import CachedRequestState, StepBatch
from sonar.worker.model_runner import PLACEHOLDER, LaunchedStep, ModelRunner
from sonar.worker.verify_passes import pass_stop_ids
from sonar_cuda.attention import TritonStepState
from sonar_cuda.decode_graphs import DecodeBuffers, DecodeGraphs, GraphedModel, default_capture_sizes, fill_padding
from sonar_cuda.draft_graphs import CudaGraphCapturer
from sonar_cuda.kernels.decode_attention import warm_up_decode_attention
from sonar_cuda.kernels.drafter_passes import DrafterPassChain
from sonar_cuda.kernels.ngram_passes import NgramPassChain

logger = logging.getLogger(__name__)

TP_GRAPHS_ENV = "SONAR_TP_CUDA_GRAPHS"  # "1": decode graphs at tensor_parallel_size > 1 capture the all-reduces


#: The most rows a verify step's decode graph is captured for (a step of more runs eagerly).
MAX_VERIFY_GRAPH_ROWS = 2048


def graph_rows_bound(config, max_graph_batch_size: int) -> int:
    """The largest decode graph's rows: ``max_graph_batch_size``, or with speculative decoding
    a verify step of the most requests that draft (``max_num_seqs``, or speculation's
    ``disable_by_batch_size``) with every draft (``k + 1`` rows each), bounded
    by the step's token budget and ``MAX_VERIFY_GRAPH_ROWS``."""
    spec = config.speculative_config
    if spec is None:
        return max_graph_batch_size
    verify_rows = min(config.max_num_seqs, spec.max_batch_size) * (spec.num_speculative_tokens + 1)
    return max(max_graph_batch_size, min(verify_rows, config.max_num_batched_tokens, MAX_VERIFY_GRAPH_ROWS))


class CudaModelRunner(ModelRunner):
    """The core model runner plus CUDA graphs for decode steps.

    ``max_graph_batch_size`` bounds the captured sizes of plain decode steps; with speculative
    decoding the sizes reach a full verify step's rows (``max_num_seqs x (k + 1)``, within the
    step's token budget and ``MAX_VERIFY_GRAPH_ROWS``), since a verify step past the largest
    graph runs eagerly at many times a replay's cost. ``enforce_eager`` (or ``SONAR_ENFORCE_EAGER=1``) turns graphs
    off (the static-buffer decode path still runs, eagerly), and so do pipeline stages and, unless
    ``SONAR_TP_CUDA_GRAPHS=1`` (an opt-in until it has been measured on several GPUs: the graphs
    then capture the NCCL all-reduces), tensor parallelism; expert parallelism always (its
    dispatch reads the split sizes on the host). On a CPU device (tests through
    Triton's interpreter) the same path runs without graphs.
    """

    max_graph_batch_size: int = 256
    #: the most prompt tokens a step runs in a decode graph (None: ``max_graph_batch_size``; 0: none)
    prompt_chunk_limit: int | None = None

    def __init__(self, model_config, config, device: torch.device, attention_backend_cls: str) -> None:
        super().__init__(model_config, config, device, attention_backend_cls)
        self.max_graph_rows = graph_rows_bound(config, self.max_graph_batch_size)
        eager = config.enforce_eager or os.environ.get("SONAR_ENFORCE_EAGER", "") in ("1", "true")
        self.use_graphs = device.type == "cuda" and not eager
        tp_graphs = os.environ.get(TP_GRAPHS_ENV, "") in ("1", "true")
        expert_parallel = config.tensor_parallel_size > 1 and config.enable_expert_parallel  # reads split sizes on the host
        if config.pipeline_parallel_size > 1 or expert_parallel or (config.tensor_parallel_size > 1 and not tp_graphs):
            self.use_graphs = False  # stage hand-overs are not captured; collectives only on request
        self.max_blocks_per_seq = self.block_table.max_blocks_per_seq
        self.graphs: DecodeGraphs | None = None
        self._prompt_chunk_rows: int | None = None
        self._pass_chain: PassChain | None = None
        # the work between passes queued at once: None, one launch for each proposer's (PassChain: separate operations)
        self.pass_chain_cls: type[PassChain] | None = None

    # -- setup ---------------------------------------------------------------------------

    def profile_peak_bytes(self, platform: type) -> int:
        """The core runner's largest step, plus what the decode graphs keep in their private
        pool: they are captured once over a one-block scratch cache, measured, and dropped."""
        step_bytes = super().profile_peak_bytes(platform)
        if not self.use_graphs:
            return step_bytes
        graph_bytes = self._profile_graph_bytes(platform)
        draft_bytes = self._profile_draft_graph_bytes(platform)
        self.profile_parts.update(largest_step_bytes=step_bytes, decode_graph_bytes=graph_bytes)
        if draft_bytes:
            self.profile_parts["draft_graph_bytes"] = draft_bytes
        logger.info(
            "profiled the largest step at %.2f GiB, decode graphs at %.2f GiB, drafter graphs at %.2f GiB",
            step_bytes / 2**30, graph_bytes / 2**30, draft_bytes / 2**30,
        )  # fmt: skip
        return step_bytes + graph_bytes + draft_bytes

    def _profile_graph_bytes(self, platform: type) -> int:
        model = self.model
        shape = (2, 1, self.block_size, model.num_kv_heads, model.head_dim)
        scratch = [self._zeros(shape) for _ in range(model.num_layers)]
        platform.synchronize()
        platform.release_cached_memory()
        before = platform.allocated_memory_bytes()
        buffers = DecodeBuffers.allocate(self.max_graph_rows, self.max_blocks_per_seq, self.device)
        graphs = DecodeGraphs(
            model, scratch, buffers, default_capture_sizes(self.max_graph_rows), self.model_config.max_model_len, True,
            lora=self._lora_batch(),
        )
        graphs.capture()
        platform.synchronize()
        used = platform.allocated_memory_bytes() - before
        del graphs, buffers, scratch
        platform.release_cached_memory()
        return max(0, used)

    def _lora_batch(self):
        """The LoRA slot buffer the graphs read (None without adapters)."""
        return self.lora.batch if self.lora is not None else None

    def draft_graph_capturer(self) -> CudaGraphCapturer | None:
        """Drafter passes are captured where decode steps are, on one rank (not with LoRA
        adapters: the target's LM head and embedding a drafter borrows would take their path)."""
        if not self.use_graphs or self.device.type != "cuda" or self.lora is not None or self.config.tensor_parallel_size > 1:
            return None
        return CudaGraphCapturer()

    def _profile_draft_graph_bytes(self, platform: type) -> int:
        """What a drafter's captured passes keep in their pool (and the pool's blocks beyond
        the target's budget): captured once over a one-block budget, measured, dropped."""
        capturer = self.draft_graph_capturer() if self.spec is not None else None
        if capturer is None:
            return 0
        config, block_size, max_model_len = self.config, self.block_size, self.model_config.max_model_len
        platform.synchronize()
        platform.release_cached_memory()
        before = platform.allocated_memory_bytes()
        self.spec.init_cache(DraftCacheBudget(1, block_size, config.max_num_seqs, max_model_len, capturer))
        platform.synchronize()
        used = platform.allocated_memory_bytes() - before
        del capturer
        self.spec.init_cache(DraftCacheBudget(1, block_size, 1, block_size))  # the graphs go; init_kv_cache sizes the real cache
        platform.release_cached_memory()
        return max(0, used)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache (and a drafter's, its passes captured), then the decode buffers
        and graphs over it."""
        super().init_kv_cache(num_blocks)
        if self.kv_connector is not None and self.kv_connector.uses_layer_hooks:  # a replay would skip them
            self.use_graphs = False
        model = self.model.model if isinstance(self.model, GraphedModel) else self.model
        max_batch = self.max_graph_rows
        buffers = DecodeBuffers.allocate(max_batch, self.max_blocks_per_seq, self.device)
        self.graphs = DecodeGraphs(
            model, self.kv_caches, buffers, default_capture_sizes(max_batch), self.model_config.max_model_len, self.use_graphs,
            lora=self._lora_batch(),
        )
        reserved_before = torch.cuda.memory_reserved() if self.device.type == "cuda" else 0
        self.graphs.capture()
        if self.device.type == "cuda":
            self.profile_parts["captured_graph_bytes"] = torch.cuda.memory_reserved() - reserved_before
        self.model = GraphedModel(model, self.graphs)
        if self.device.type == "cuda":  # compile the eager decode path's split-KV variants now
            kv = self.kv_caches[0]
            num_heads = self.model_config.hf_config.num_attention_heads
            warm_up_decode_attention(kv[0], kv[1], num_heads, self.model_config.dtype)

    def step_cost_edges(self) -> list[int]:
        """The largest decode graph's rows and one more: a step past them runs eagerly, at
        several times the cost of a replay on a large model."""
        if self.graphs is None or not self.graphs.graphs:
            return []
        return [self.graphs.max_size, self.graphs.max_size + 1]

    def device_benchmarks(self) -> dict[str, float]:
        """The device time of one replay of the largest decode graph (CUDA events, no host
        work; it rewrites the last step's keys and values with the same values)."""
        graphs = self.graphs
        if graphs is None or not graphs.graphs or self.device.type != "cuda":
            return {}
        size = graphs.max_size
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graphs.run(size)
        start.record()
        for _ in range(10):
            graphs.run(size)
        end.record()
        torch.cuda.synchronize()
        return {f"device: one decode-graph replay at batch {size}": round(start.elapsed_time(end) / 10, 3)}

    # -- one step ------------------------------------------------------------------------

    @property
    def prompt_chunk_rows(self) -> int:
        """The most tokens of a request's prompt that a step runs in a decode graph, one row a
        token (0: prompts run eagerly): up to ``prompt_chunk_limit``, where no proposer
        reads the step's hidden states and no adapters are served. A short prompt's prefill
        then costs a graph replay instead of a launch per operation."""
        if self._prompt_chunk_rows is None:
            spec, graphs = self.spec, self.graphs
            reads_states = spec is not None and (spec.hidden is not None or (graphs.aux is not None and bool(graphs.aux.layer_ids)))
            limit = self.max_graph_batch_size if self.prompt_chunk_limit is None else self.prompt_chunk_limit
            self._prompt_chunk_rows = 0 if reads_states or self.lora is not None else min(graphs.max_size, limit)
        return self._prompt_chunk_rows

    def _graph_rows(self, states: list[CachedRequestState], num_scheduled: list[int]) -> tuple[int, bool]:
        """The rows a decode graph would run this step on (0: it cannot), and whether the step
        is a plain decode step (one row a request). A request adds its one known token, plus
        its drafts when it verifies some; or a chunk of its prompt (``prompt_chunk_rows``);
        and none wants prompt logprobs."""
        if self.graphs is None or not states:
            return 0, False
        rows, plain = 0, True
        for state, n in zip(states, num_scheduled):
            drafts = len(state.draft_token_ids)
            if state.num_computed_tokens + 1 == state.num_tokens and n == 1 + drafts:
                if drafts and state.sampling.output_token_ids[-1:] == [PLACEHOLDER]:
                    return 0, False  # a verify row's known token must be on the host already
                plain = plain and not drafts
            elif drafts or n > self.prompt_chunk_rows or state.num_computed_tokens + n > state.num_tokens:
                return 0, False
            else:
                plain = False
            if state.sampling.params.prompt_logprobs is not None and state.num_computed_tokens < len(state.prompt_token_ids):
                return 0, False
            rows += n
        return (rows, plain) if rows <= self.graphs.max_size else (0, False)

    def build_batch(self, states: list[CachedRequestState], num_scheduled: list[int]) -> StepBatch:
        """Decode steps go into the graphs' static buffers; others to the core builder.

        A verify step (speculative decoding) runs in the same graphs: a request with ``k``
        drafts takes ``k + 1`` rows, one per token, each attending to the context up to its
        own position through the request's block table, which is exactly the causal attention
        of its ``k + 1`` query tokens."""
        n, plain = self._graph_rows(states, num_scheduled)
        if not n:
            return super().build_batch(states, num_scheduled)
        if not plain:
            return self._build_rows_batch(states, num_scheduled, n)
        graphs = self.graphs
        buffers = graphs.buffers
        size = graphs.size_for(n)

        # host side: rows of the block table, positions, slots, last tokens (a token still
        # being sampled by the step before is a placeholder here, fed on the device)
        host = buffers.next_host()
        tables = host.block_tables.numpy()
        self.block_table.gather([s.req_id for s in states], out=tables[:n])
        positions = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=n)
        tokens = host.tokens.numpy()
        tokens[0, :n] = [s.token_at(s.num_computed_tokens) for s in states]
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

    def _build_rows_batch(self, states: list[CachedRequestState], num_scheduled: list[int], n: int) -> StepBatch:
        """A step laid out one row per token (see :meth:`build_batch`): verify steps, and
        prompt chunks, whose rows attend as a prefill's tokens do; a request is sampled where
        its rows reach its last token (a verify request at every row)."""
        graphs = self.graphs
        buffers = graphs.buffers
        size = graphs.size_for(n)
        host = buffers.next_host()
        counts = np.asarray(num_scheduled, dtype=np.int64)
        request_of_row = np.repeat(np.arange(len(states)), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        tables = host.block_tables.numpy()
        self.block_table.gather([s.req_id for s in states], out=tables[: len(states)])
        tables[:n] = tables[request_of_row]  # each request's row once per token (the gather filled its first rows)
        first = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        positions = first[request_of_row] + np.arange(n) - starts[request_of_row]
        tokens = host.tokens.numpy()
        tokens[0, :n] = [t for s, c in zip(states, num_scheduled)
                         for t in ((s.token_at(s.num_computed_tokens), *s.draft_token_ids) if s.draft_token_ids else s.token_ids(s.num_computed_tokens, s.num_computed_tokens + c))]  # fmt: skip
        tokens[1, :n] = positions
        block_size = self.block_size
        tokens[2, :n] = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
        seq_lens = positions + 1
        host.seq_lens.numpy()[:n] = seq_lens
        fill_padding(host, n)
        buffers.upload(host, n)
        metadata: AttentionMetadata = buffers.metadata(size, seq_lens.tolist(), graphs.states[size])
        sample_rows = [i for i, (s, c) in enumerate(zip(states, num_scheduled)) if s.num_computed_tokens + c - len(s.draft_token_ids) == s.num_tokens]
        has_drafts = any(s.draft_token_ids for s in states)
        ends = starts + counts
        indices = np.concatenate([np.arange(ends[i] - len(states[i].draft_token_ids) - 1, ends[i]) for i in sample_rows]) if sample_rows else np.zeros(0, np.int64)
        if len(indices) == n:  # every row sampled (a verify step): the buffer of 0, 1, 2, ...
            logits_indices = buffers.logits_indices[:n]
        else:
            logits_indices = to_device(indices, self.device, torch.int64)
        return StepBatch(
            states=list(states),
            num_scheduled=list(num_scheduled),
            input_ids=buffers.tokens[0, :n],
            positions=buffers.tokens[1, :n],
            attn_metadata=metadata,
            sample_rows=sample_rows,
            logits_indices=logits_indices,
            sample_drafts=[list(states[i].draft_token_ids) for i in sample_rows] if has_drafts else None,
        )

    # -- verify passes queued at once -----------------------------------------------------

    def _further_passes(self, step: LaunchedStep, batch: StepBatch, rows: int) -> StepBatch:
        """Where the proposer drafts on the device and the passes fit a decode graph, queue
        every further pass of the step at once (``PassChain``): each replays the graph of
        ``k + 1`` rows on inputs the device laid out from the pass before, so no pass waits
        for the host. Anything else takes the core runner's loop, which reads each pass back."""
        chain = self._chain_for(step, batch, rows)
        if chain is None:
            return super()._further_passes(step, batch, rows)
        state = batch.states[0]
        sampling = state.sampling
        params = sampling.params
        graphs = self.graphs
        buffers = graphs.buffers
        width = chain.k + 1
        size = graphs.size_for(width)
        end = state.num_computed_tokens + batch.num_scheduled[0] + rows
        chain.begin(state.token_ids(0, state.num_tokens), end, len(sampling.output_token_ids), params.max_tokens, pass_stop_ids(sampling),
                    buffers.block_tables[0], self.block_size, len(step.verified.layout.drafts[0]))  # fmt: skip
        # the graph's rows past the pass's: padding; every row reads the request's block table
        buffers.block_tables[1:size].copy_(buffers.block_tables[0].expand(size - 1, -1))
        buffers.tokens[:2, width:size].zero_()
        buffers.tokens[2, width:size].fill_(-1)
        buffers.seq_lens[width:size].fill_(1)
        rows_in = PassRows(buffers.tokens[0, :width], buffers.tokens[1, :width], buffers.tokens[2, :width], buffers.seq_lens[:width])
        greedy, inputs = step.verified.result.token_ids, batch.input_ids
        num_passes = min(self.spec.config.verify_passes - 1, rows)
        if step.chained is not None:
            self._queue_drafter_passes(step, chain, inputs, rows_in, size, num_passes)
            return batch
        for _ in range(num_passes):
            chain.advance(greedy, inputs, rows_in, self.spec.proposer)
            hidden = graphs.run(size)[:width]
            greedy, inputs = ops.argmax(self.model.compute_logits(hidden)), rows_in.token_ids
        chain.settle(greedy, inputs)
        step.device_passes = chain.finish()
        return batch

    def _queue_drafter_passes(self, step: LaunchedStep, chain: PassChain, inputs: torch.Tensor, rows_in: PassRows, size: int, num_passes: int) -> None:
        """The passes of a drafter that drafts in passes (DFlash, DSpark), all queued: the
        first pass's drafts were chained behind it; after each later pass the drafter takes
        its kept states and drafts after its last token (``Proposer.propose_pass``), and the
        drafts after the last pass are the next step's, chained as usual."""
        proposer, graphs, width = self.spec.proposer, self.graphs, chain.k + 1
        chained = step.chained
        req_id = chained.req_ids[0]
        started = time.perf_counter()
        greedy = step.verified.result.token_ids
        drafts, survival = chained.on_device[0], None
        positions = torch.empty_like(rows_in.positions)
        for index in range(num_passes + 1):
            chain.settle(greedy, inputs)
            if index:  # the pass just settled: its kept states into the drafter, and its drafts
                anchor, anchor_position = chain.anchor()
                drafts, survival = proposer.propose_pass(req_id, graphs.aux.latest[:width], positions, chain.kept_rows, anchor, anchor_position)
            if index == num_passes:
                break
            chain.lay_out(rows_in, drafts, chain.k)
            positions.copy_(rows_in.positions)  # the next lay-out overwrites the buffer before the drafter reads it
            hidden = graphs.run(size)[:width]
            greedy, inputs = ops.argmax(self.model.compute_logits(hidden)), rows_in.token_ids
        step.device_passes = chain.finish()
        token_ids = drafts.view(1, -1)  # a block's num_speculative_tokens drafts
        confidence = None if survival is None else survival.view(1, -1).to("cpu", non_blocking=True)
        step.chained = ChainedProposal([req_id], token_ids.to("cpu", non_blocking=True), confidence, chained.seconds + time.perf_counter() - started, token_ids)

    def _chain_for(self, step: LaunchedStep, batch: StepBatch, rows: int) -> PassChain | None:
        """The runner's ``PassChain`` where this step's passes may be queued at once: the
        proposer drafts on the device (from the sequence, or in passes from the target's
        states, with room for ``rows`` more positions made in its context), the first pass
        ran in the graphs' buffers, a pass's ``k + 1`` rows fit a graph, no adapters, and
        greedy is a plain argmax for the request (no bias, allowed or banned tokens, no bad
        words, ``min_tokens`` reached)."""
        spec, graphs = self.spec, self.graphs
        extra = batch.attn_metadata.extra if batch.attn_metadata is not None else None
        k = spec.config.num_speculative_tokens
        proposer = spec.proposer
        in_passes = step.chained is not None  # a drafter's next drafts chained behind the first pass
        if not (proposer.drafts_in_passes if in_passes else proposer.drafts_on_device):
            return None
        if graphs is None or self.lora is not None or k + 1 > graphs.max_size:
            return None
        if in_passes and (graphs.aux is None or not graphs.aux.layer_ids):
            return None
        if not isinstance(extra, TritonStepState) or not extra.graph_batch_size:
            return None
        sampling = batch.states[0].sampling
        if sampling.params.bad_words_token_ids or SamplingMetadata.build([sampling], self.model_config.vocab_size, self.device).edits_logits:
            return None
        if in_passes and not proposer.begin_passes(step.chained.req_ids[0], rows):
            return None
        if self._pass_chain is None:
            chain_cls = self.pass_chain_cls or (DrafterPassChain if in_passes else NgramPassChain)
            max_passes = min(spec.config.verify_passes, self.model_config.max_model_len)  # a step's rows bound its passes
            self._pass_chain = chain_cls(self.model_config.max_model_len, k, max_passes, self.device)
        return self._pass_chain
