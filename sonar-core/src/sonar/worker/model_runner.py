"""Runs the model for one scheduler step on one device: inputs, forward, logits, sampling."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sonar import ops
from sonar.attention import AttentionBackend, ForwardContext
from sonar.config import EngineConfig, ModelConfig, kv_cache_torch_dtype
from sonar.engine.scheduler_output import ModelRunnerOutput, RequestLogprobs, SchedulerOutput
from sonar.kv_transfer.factory import build_kv_connector
from sonar.kv_transfer.interface import KVCacheLayout, KVConnector, KVConnectorOutput, KVConnectorRole
from sonar.lora.manager import LoRAManager
from sonar.lora.request import LoRARequest
from sonar.model_interface import make_attention_factory, settle_kv_cache_scales
from sonar.pipeline import WHOLE_MODEL, IntermediateTensors, PipelineStage, current_stage
from sonar.quantization import building_with, quantization_method_of
from sonar.registry import import_class, resolve_model_class, weight_formats
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata
from sonar.sampler.sampler import LogprobsTensors, Sampler, compute_logprobs
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.device_passes import DevicePasses
from sonar.spec_decode.hidden_states import StepHiddenStates
from sonar.spec_decode.draft_graphs import GraphCapturer
from sonar.spec_decode.interface import DraftCacheBudget
from sonar.spec_decode.verifier import first_logits_rows
from sonar.spec_decode.worker_side import ChainedProposal, SpeculativeDecoder, VerifiedStep
from sonar.structured_output.bitmask import apply_grammar_bitmask
from sonar.tensors import to_device
from sonar.worker.block_table import BlockTable
from sonar.worker.input_batch import CachedRequestState, StepBatch, build_step_batch
from sonar.worker.verify_passes import VerifyPasses

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # an output token sampled by a step whose results are not back yet
PROMPT_LOGPROBS_ROWS = 512  # prompt logprobs are computed this many positions at a time
LORA_MIN_ROWS = 512  # the LoRA slot buffer holds at least this many rows (decode graphs pad up to their size)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step queued on the device; ``ModelRunner.fetch`` turns it into its output."""

    req_ids: list[str] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows of req_ids that sampled a token
    sample_req_ids: list[str] = field(default_factory=list)
    logprob_ks: list[int | None] = field(default_factory=list)
    prompt_logprobs: dict[str, RequestLogprobs] = field(default_factory=dict)
    sampled_on_device: torch.Tensor | None = None  # the next step feeds its pending tokens from here
    sample_row_of: dict[str, int] = field(default_factory=dict)  # request -> row of sampled_on_device
    sampled: torch.Tensor | None = None  # host copy of the sampled ids (valid once ready)
    logprobs: LogprobsTensors | None = None  # host copies
    ready: torch.Event | None = None  # recorded after the copies; None on the CPU
    placeholders: list[tuple[list[int], int]] = field(default_factory=list)  # (output list, index) per sampled row
    output: ModelRunnerOutput | None = None  # set once resolved
    sample_states: list[CachedRequestState] = field(default_factory=list)  # of the sampled rows
    verified: VerifiedStep | None = None  # a verify step's device results (speculative decoding)
    num_accepted: torch.Tensor | None = None  # host copy of verified's drafts kept per request (None: counted on the host)
    hidden: StepHiddenStates | None = None  # the states a proposer reads (needs_hidden_states)
    kv_connector_output: KVConnectorOutput | None = None  # transfers the KV connector finished by its launch
    propose: bool = True  # the proposer drafts once its tokens are known (the scheduler's say)
    draft_limit: int | None = None  # for at most this many requests (None: every one)
    chained: ChainedProposal | None = None  # the next drafts, queued behind verification
    # a step of several verify passes (its one request): the tokens the passes before the last
    # emitted, and each pass's [drafts, kept] but the last's (known once it is read back)
    early_tokens: list[int] | None = None
    passes: list[list[int]] = field(default_factory=list)
    device_passes: DevicePasses | None = None  # the passes queued on the device at once (all of them)


def _to_request_logprobs(tensors: LogprobsTensors, rows: slice | list[int], k: int) -> RequestLogprobs:
    return RequestLogprobs(
        token_ids=tensors.token_ids[rows, : k + 1].tolist(),
        logprobs=tensors.logprobs[rows, : k + 1].tolist(),
        ranks=tensors.ranks[rows].tolist(),
    )


def build_model(model_config: ModelConfig, device: torch.device, backend_cls: type[AttentionBackend] | None) -> torch.nn.Module:
    """The registered architecture of ``model_config``, built on ``device`` in its dtype with
    ``backend_cls`` attention (and its quantization method's layers), weights not yet loaded."""
    model_cls = resolve_model_class(model_config.hf_config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device), building_with(quantization_method_of(model_config)):
            return model_cls(model_config.hf_config, make_attention_factory(backend_cls))
    finally:
        torch.set_default_dtype(previous_dtype)


def load_weights(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """Fill a built model's weights: streamed from its checkpoint, or drawn in place where the
    weight format initializes weights itself (random ones)."""
    fmt = weight_formats()[model_config.load_format]
    if hasattr(fmt, "init_weights"):
        fmt.init_weights(model)
    else:
        model.load_weights(fmt.iter_weights(Path(model_config.model), model_config.hf_config))


class ModelRunner(VerifyPasses):
    """Runs steps of one model on one device. Platform runners subclass it and override
    ``build_batch`` (inputs into their own buffers), ``init_kv_cache`` (what depends on the
    cache, such as graphs) and ``profile_peak_bytes`` (memory their extras need)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, device: torch.device, attention_backend_cls: str) -> None:
        self.model_config = model_config
        self.config = config
        self.block_size = block_size = config.block_size
        self.device = device
        self.backend_cls: type[AttentionBackend] | None = import_class(attention_backend_cls) if attention_backend_cls else None
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector: KVConnector | None = None  # the worker half, once the cache exists
        self.requests: dict[str, CachedRequestState] = {}
        self.preempted_samplings: dict[str, RequestSamplingState] = {}
        self.block_table = BlockTable(-(-model_config.max_model_len // block_size) + 1)
        self.profile_parts: dict[str, int] = {}  # what the memory profile measured, by part
        self.sampler = Sampler()
        self._last_sampling: LaunchedStep | None = None  # the last launched step that sampled
        spec = config.speculative_config
        self.spec: SpeculativeDecoder | None = None if spec is None else SpeculativeDecoder(spec, device)
        self.lora: LoRAManager | None = None  # with enable_lora, once the model is loaded
        self.stage: PipelineStage = WHOLE_MODEL  # the pipeline stage it runs, set when the model is built

    # -- setup ---------------------------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        """The registered architecture's module, built on the device in the model's dtype,
        its weights not yet loaded."""
        return build_model(self.model_config, self.device, self.backend_cls)

    def load_model(self) -> None:
        """Build the model on the device and load its weights: streamed from the checkpoint,
        or drawn in place where the weight format initializes weights itself (random ones)."""
        config = self.model_config
        started = time.perf_counter()
        self.stage = current_stage()
        model = self.build_model()
        load_weights(model, config)
        self.model = model.to(self.device).eval()
        if self.config.enable_lora:
            self.init_lora()
        if self.spec is not None:
            self.spec.load_model(self.model, self)
        logger.info("loaded %s in %.1f s", type(model).__name__, time.perf_counter() - started)

    def init_lora(self) -> None:
        """Give every linear layer of the loaded model its LoRA adapter slots."""
        config = self.config
        rows = max(config.max_num_batched_tokens, LORA_MIN_ROWS)
        self.lora = LoRAManager(
            self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, rows, self.model_config.dtype, self.device
        )

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read, check and keep an adapter.

        :raises LoRAError: it cannot be served on this model, or LoRA is off.
        """
        if self.lora is None:
            from sonar.lora.errors import LoRAError

            raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def profile_peak_bytes(self, platform: type) -> int:
        """Device memory the largest step the configuration allows needs beyond what is
        allocated now (run once, on dummy inputs, before the KV cache exists)."""
        return profile_peak_bytes(self, platform)

    def phase_targets(self) -> list[tuple[object, str, str]]:
        """The parts of ``launch`` and ``fetch`` a benchmark may time: ``(object, method, label)``."""
        return [
            (self, "_wait_for_device", "fetch: device_wait"),
            (self, "_update_states", "launch: update_states"),
            (self, "build_batch", "launch: build_batch"),
            (self, "_feed_pending_tokens", "launch: feed_pending"),
            (self.model, "forward", "launch: forward"),
            (self.sampler, "sample", "launch: sampler"),  # the sampler itself stays: verification calls its parts
            (self.model, "compute_logits", "launch: compute_logits"),
            (self, "_prompt_logprobs", "launch: prompt_logprobs"),
            (SamplingMetadata, "build", "launch: sampling_metadata"),
            *(self.spec.phase_targets() if self.spec is not None else ()),
        ]

    def device_benchmarks(self) -> dict[str, float]:
        """Device-only timings this runner can take (none here; platform runners add theirs)."""
        return {}

    def kv_cache_specs(self) -> list | None:
        """The model's ``KVCacheSpec`` per layer; None where it declares none (full attention)."""
        specs = getattr(self.model, "kv_cache_specs", None)
        return specs() if callable(specs) else None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the KV cache stores (``kv_cache_dtype``: the model's dtype, FP8 E4M3 or FP8 E5M2)."""
        return kv_cache_torch_dtype(self.config.kv_cache_dtype, self.model_config.dtype)

    def kv_bytes_per_block(self) -> int:
        model = self.model
        element = torch.empty(0, dtype=self.kv_cache_dtype).element_size()
        target = 2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim * element
        # a drafter's own paged cache is sized from the same block count (init_cache)
        return target + (self.spec.cache_bytes_per_block(self.block_size) if self.spec is not None else 0)

    def init_kv_cache(self, num_blocks: int) -> None:
        model = self.model
        shape = (2, num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        settle_kv_cache_scales(model, self.kv_cache_dtype)
        self.kv_caches = [self._zeros(shape) for _ in range(model.num_layers)]
        if self.spec is not None:
            config = self.config
            budget = DraftCacheBudget(num_blocks, self.block_size, config.max_num_seqs, self.model_config.max_model_len, self.draft_graph_capturer())
            self.spec.init_cache(budget)
        if self.config.kv_transfer_config is not None:
            self.kv_connector = build_kv_connector(self.config.kv_transfer_config, KVConnectorRole.WORKER, self.kv_cache_layout())
            self.kv_connector.register_kv_caches(self.kv_caches)

    def draft_graph_capturer(self) -> GraphCapturer | None:
        """What captures a drafter's passes in graphs on this runner's platform (None here:
        they run eagerly; platform runners that capture graphs return theirs)."""
        return None

    def step_cost_edges(self) -> list[int]:
        """Token counts at which a step's cost jumps (none here; a runner that replays graphs
        up to some size gives that size and the next, past which steps run eagerly), for the
        step-cost profile to time besides its grid."""
        return []

    def kv_cache_layout(self) -> KVCacheLayout:
        """The allocated KV cache, as a KV connector sees it."""
        from sonar.config import dtype_name

        model = self.model
        architectures = getattr(self.model_config.hf_config, "architectures", None) or [type(model).__name__]
        return KVCacheLayout(
            model=f"{Path(self.model_config.model).name}:{architectures[0]}",
            dtype=dtype_name(self.kv_cache_dtype),
            block_size=self.block_size,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_blocks=self.kv_caches[0].shape[1] if self.kv_caches else 0,
        )

    def _kv_connector_output(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        """What the connector finished since the last step (None: nothing)."""
        connector = self.kv_connector
        if connector is None:
            return None
        sending, recving = connector.get_finished(so.finished_req_ids)
        failed = connector.get_failed_loads()
        if not (sending or recving or failed):
            return None
        return KVConnectorOutput(set(sending), set(recving), set(failed))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = self.kv_cache_dtype
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        # host memory: calloc'd pages are zero without being touched, so a large cache costs
        # nothing until it is used
        num_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)

    # -- request state -------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.spec is not None and so.finished_req_ids:
            self.spec.remove_requests(so.finished_req_ids)
        for req_id in so.finished_req_ids:
            self.block_table.remove(req_id)
            state = self.requests.pop(req_id, None)
            if req_id in so.preempted_req_ids:
                if state is not None:  # it comes back: keep its generator and sampler state
                    self.preempted_samplings[req_id] = state.sampling
            else:
                self.preempted_samplings.pop(req_id, None)
        for new in so.new_reqs:
            previous = self.preempted_samplings.pop(new.req_id, None)
            params = new.sampling_params
            generator = None
            if previous is None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            sampling = RequestSamplingState(
                params=params,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                generator=generator,
                eos_token_ids=new.eos_token_ids,
            )
            if previous is not None:
                sampling.carry_over(previous)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                num_computed_tokens=new.num_computed_tokens,
                sampling=sampling,
                lora_int_id=new.lora_int_id,
            )
            self.block_table.add(new.req_id, new.block_ids)
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            self.block_table.append(cached.req_id, cached.new_block_ids)
            if cached.new_token_ids and not self.stage.is_last:  # pipeline parallelism: sampled on the last stage
                state.sampling.output_token_ids.extend(cached.new_token_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            self.requests[req_id].draft_token_ids = drafts

    # -- one step ------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.fetch(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Queue one step's work on the device and return without waiting for it.

        Each sampled token is appended to its request as a placeholder; ``fetch`` fills in the
        value. The next step may be launched first: a decode that feeds a placeholder takes
        the value straight from the previous step's sampled ids on the device. A batch with a
        request whose sampling reads earlier tokens' values waits for the previous step first.

        A step that carries prompt tokens runs the exact quantized products
        (``sonar.ops.exact_products``): its last prompt positions decide first tokens.

        A step the scheduler gave rows for further verify passes (``spec_pass_rows``, from
        ``verify_passes``) runs them before it returns, all but the last waited for
        (``_further_passes``).
        """
        self._update_states(so)
        with ops.exact_products(self._carries_prompt(so)):
            return self._launch(so)

    def _prepare_forward(self, batch: StepBatch) -> None:
        """The step's adapters into their slots (none: the LoRA path stays off) and the
        attention backend's per-step metadata, once for all layers."""
        if self.lora is not None:
            self.lora.prepare_step([s.lora_int_id for s in batch.states], batch.num_scheduled)
        if self.backend_cls is not None:
            self.backend_cls.prepare_metadata(batch.attn_metadata)

    def _carries_prompt(self, so: SchedulerOutput) -> bool:
        """Whether a request in the step computes prompt tokens (a prefill chunk, or tokens a
        preempted request recomputes), not just its next token and its drafts."""
        for req_id, count in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ())) + so.spec_pass_rows.get(req_id, 0)
            if count - drafts > 1 or state.num_computed_tokens < len(state.prompt_token_ids):
                return True
        return False

    def _launch(self, so: SchedulerOutput) -> LaunchedStep:
        connector = self.kv_connector
        if connector is not None and so.kv_connector_metadata is not None:
            connector.start_load_kv(so.kv_connector_metadata)
        if so.is_empty:
            return LaunchedStep(output=ModelRunnerOutput([], [], [], kv_connector_output=self._kv_connector_output(so)))
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        last = self._last_sampling
        if last is not None and last.output is None and any(s.sampling.reads_output_tokens for s in states):
            self._resolve(last)
        pass_rows = so.spec_pass_rows  # rows for further verify passes: not in the first
        batch = self.build_batch(states, [so.num_scheduled_tokens[r] - pass_rows.get(r, 0) for r in req_ids])
        for req_id in so.scheduled_spec_decode_tokens:  # laid out in the batch: used once
            self.requests[req_id].draft_token_ids = []
        self._feed_pending_tokens(batch)
        self._prepare_forward(batch)
        hooked = connector if connector is not None and connector.needs_layer_hooks(so.kv_connector_metadata) else None
        ctx = ForwardContext(batch.attn_metadata, self.kv_caches, hooked)
        if self.stage.is_single:
            hidden = self.model(batch.input_ids, batch.positions, ctx)  # [num_tokens, hidden]
        else:
            hidden = self._forward_stage(batch, ctx)
            if hidden is None:  # a stage before the last: its output went on to the next stage
                return self._handed_on(batch)
        if connector is not None:
            connector.wait_for_save()

        step = LaunchedStep(
            req_ids=[s.req_id for s in batch.states],
            sample_rows=batch.sample_rows,
            prompt_logprobs=self._prompt_logprobs(batch, hidden),
            kv_connector_output=self._kv_connector_output(so),
            propose=so.propose_drafts,
            draft_limit=so.draft_limit,
        )
        if self.spec is not None and self.spec.hidden is not None:  # an EAGLE-style proposer reads them
            step.hidden = self.spec.record_hidden_states(batch, hidden)
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampled, vocab]
            sampling_states = [batch.states[row].sampling for row in batch.sample_rows]
            sample_req_ids = [batch.states[row].req_id for row in batch.sample_rows]
            drafts = batch.sample_drafts
            if drafts is None and pass_rows and len(batch.states) == 1:  # passes after a first one without drafts
                drafts = [[]]
            if so.grammar_req_ids:  # structured output: the engine core's bitmask
                first_rows = range(len(sample_req_ids)) if drafts is None else first_logits_rows(drafts)
                row_of = {req_id: first_rows[i] for i, req_id in enumerate(sample_req_ids)}
                rows = [row_of[req_id] for req_id in so.grammar_req_ids]
                apply_grammar_bitmask(logits, so.grammar_bitmask, rows, self.model_config.vocab_size)
            if self.spec is not None:  # the proposer reads the sampled requests' sequences
                step.sample_states = [batch.states[row] for row in batch.sample_rows]
            step.sample_req_ids = sample_req_ids
            step.logprob_ks = [s.params.logprobs for s in sampling_states]
            if drafts is not None:
                self._launch_verify(step, logits, sampling_states, drafts, len(batch.states))
                if pass_rows and self._may_run_passes(step, batch):
                    batch = self._further_passes(step, batch, pass_rows.get(batch.states[0].req_id, 0))
            else:
                meta = SamplingMetadata.build(sampling_states, logits.shape[-1], self.device)
                result = self.sampler(logits, meta)
                sampled = result.sampled_token_ids
                step.sampled_on_device = sampled
                step.sample_row_of = {req_id: i for i, req_id in enumerate(sample_req_ids)}
                step.sampled = sampled.to("cpu", non_blocking=True)
                if result.logprobs is not None:
                    step.logprobs = _to_host(result.logprobs)
            if self.device.type != "cpu":
                step.ready = torch.Event(device=self.device)
                step.ready.record()
        sample_rows = set(batch.sample_rows)
        for row, state in enumerate(batch.states):
            state.num_computed_tokens += batch.num_scheduled[row]
            if row in sample_rows:
                outputs = state.sampling.output_token_ids
                step.placeholders.append((outputs, len(outputs)))
                outputs.append(PLACEHOLDER)
        if batch.sample_rows:
            self._last_sampling = step
        return step

    def _forward_stage(self, batch: StepBatch, ctx: ForwardContext) -> torch.Tensor | None:
        """Pipeline parallelism: run this stage's layers on the previous stage's output (the
        first stage: on the tokens), then hand the result to the next stage and return None,
        or, on the last stage, return the final hidden states ``[num_tokens, hidden]``."""
        stage = self.stage
        intermediate = None
        if not stage.is_first:
            hidden_size = self.model_config.hf_config.hidden_size
            intermediate = stage.link.receive(batch.positions.shape[0], hidden_size, self.model_config.dtype, self.device)
        out = self.model(batch.input_ids, batch.positions, ctx, intermediate)
        if stage.is_last:
            return out
        stage.link.send(out)
        return None

    def _handed_on(self, batch: StepBatch) -> LaunchedStep:
        """A stage before the last: the step is done here once its output is sent; the requests
        advance, and the tokens the last stage samples arrive with a later step."""
        for row, state in enumerate(batch.states):
            state.num_computed_tokens += batch.num_scheduled[row]
        req_ids = [s.req_id for s in batch.states]
        none = [None] * len(req_ids)
        return LaunchedStep(req_ids=req_ids, output=ModelRunnerOutput(req_ids, list(none), list(none)))

    def _launch_verify(
        self,
        step: LaunchedStep,
        logits: torch.Tensor,
        sampling_states: list[RequestSamplingState],
        drafts: list[list[int]],
        num_requests: int,
    ) -> None:
        """Verify the step's drafts (speculative decoding), queue the next step's drafts behind
        it where the proposer chains and the step allows, and queue the copies of its results."""
        verified = self.spec.verify(self.sampler, logits, sampling_states, drafts, step.sample_req_ids)
        step.verified = verified
        if step.propose and self.stage.is_single:
            step.chained = self.spec.chain(verified, step.hidden, step.sample_req_ids, step.sample_states, num_requests, step.draft_limit)
        step.sampled = verified.result.token_ids.to("cpu", non_blocking=True)
        if verified.result.num_accepted is not None:  # else counted from the tokens once they arrive
            step.num_accepted = verified.result.num_accepted.to("cpu", non_blocking=True)
        if verified.logprobs is not None:
            step.logprobs = _to_host(verified.logprobs)

    def fetch(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step and return its results."""
        self._resolve(step)
        return step.output

    def _resolve(self, step: LaunchedStep) -> None:
        """Wait for the step's sampled ids, put them in place of its placeholders, advance the
        grammars, and build its output (once)."""
        if step.output is not None:
            return
        if step.ready is not None:
            self._wait_for_device(step.ready)
        if step.verified is not None:
            self._resolve_verified(step)
        else:
            self._resolve_sampled(step)
        step.output.kv_connector_output = step.kv_connector_output
        if self.spec is not None and step.sample_states:
            drafting = step.propose and len(step.req_ids) <= self.spec.config.max_batch_size
            self.spec.after_step(step.output, step.sample_req_ids, step.sample_states, step.hidden, drafting, step.draft_limit, step.chained)

    @staticmethod
    def _wait_for_device(ready: torch.Event) -> None:
        """Wait until the step's results are on the host (its event has completed)."""
        ready.synchronize()

    def _resolve_verified(self, step: LaunchedStep) -> None:
        """A verify step's output: each request's kept drafts and the token after them, put in
        place of its placeholder; its rejected positions are taken back."""
        if step.device_passes is not None:
            self._resolve_device_passes(step)
            return
        token_ids = step.sampled.tolist()
        layout = step.verified.layout
        num_accepted = layout.leading_matches(token_ids) if step.num_accepted is None else step.num_accepted.tolist()
        sampled: list[int | None] = [None] * len(step.req_ids)
        logprobs: list[RequestLogprobs | None] = [None] * len(step.req_ids)
        verified: dict[str, list[int]] = {}
        passes: dict[str, list[list[int]]] = {}
        for i, row in enumerate(step.sample_rows):
            start, accepted = layout.starts[i], num_accepted[i]
            tokens = token_ids[start : start + accepted + 1]
            outputs, index = step.placeholders[i]
            outputs[index : index + 1] = tokens
            if layout.num_drafts[i]:
                step.sample_states[i].num_computed_tokens -= layout.num_drafts[i] - accepted
            if step.early_tokens is not None:  # several passes (a lone request): all their tokens
                passes[step.req_ids[row]] = [*step.passes, [layout.num_drafts[i], accepted]]
                tokens = step.early_tokens + tokens
            sampled[row] = tokens[0]
            if layout.num_drafts[i] or step.early_tokens is not None:
                verified[step.req_ids[row]] = tokens
            k = step.logprob_ks[i]
            if k is not None and step.logprobs is not None:
                logprobs[row] = _to_request_logprobs(step.logprobs, list(range(start, start + accepted + 1)), k)
        step.output = ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs,
            verified_token_ids=verified, verified_passes=passes,
        )

    def _resolve_sampled(self, step: LaunchedStep) -> None:
        token_ids = step.sampled.tolist() if step.sampled is not None else []
        for (outputs, index), token_id in zip(step.placeholders, token_ids):
            outputs[index] = token_id
        sampled: list[int | None] = [None] * len(step.req_ids)
        logprobs: list[RequestLogprobs | None] = [None] * len(step.req_ids)
        for i, row in enumerate(step.sample_rows):
            sampled[row] = token_ids[i]
            k = step.logprob_ks[i]
            if k is not None and step.logprobs is not None:
                logprobs[row] = _to_request_logprobs(step.logprobs, [i], k)
        step.output = ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs
        )

    def _feed_pending_tokens(self, batch: StepBatch) -> None:
        """Replace the placeholders among the batch's input ids (the previous step's sampled
        tokens, not back on the host yet) with their values, on the device."""
        rows = [row for row, s in enumerate(batch.states) if s.sampling.output_token_ids[-1:] == [PLACEHOLDER]]
        if not rows:
            return
        last = self._last_sampling  # the only step whose tokens can still be placeholders
        starts = batch.token_starts()
        src, dst = [], []
        for row in rows:
            state = batch.states[row]
            if state.num_computed_tokens + batch.num_scheduled[row] != state.num_tokens:
                raise RuntimeError(f"request {state.req_id}: a step reads a token that is not sampled yet")
            src.append(last.sample_row_of[state.req_id])
            dst.append(starts[row] + batch.num_scheduled[row] - 1)
        count = len(rows)
        if src == dst == list(range(count)):
            batch.input_ids[:count].copy_(last.sampled_on_device[:count])
        else:
            index = to_device(torch.tensor([dst, src], dtype=torch.int64), self.device)
            batch.input_ids[index[0]] = last.sampled_on_device[index[1]]

    def build_batch(self, states: list[CachedRequestState], num_scheduled: list[int]) -> StepBatch:
        """One step's device inputs (hook: platform runners build them into static buffers)."""
        return build_step_batch(states, num_scheduled, self.block_table, self.block_size, self.device)

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, RequestLogprobs]:
        results: dict[str, RequestLogprobs] = {}
        starts = None  # each request's first token row, once a request asks
        for row, state in enumerate(batch.states):
            k = state.sampling.params.prompt_logprobs
            start = state.num_computed_tokens
            num_prompt = len(state.prompt_token_ids)
            if k is None or start >= num_prompt:
                continue
            # positions start .. end-1 predict the prompt tokens start+1 .. end
            end = min(start + batch.num_scheduled[row], num_prompt - 1)
            if end <= start:
                results[state.req_id] = RequestLogprobs([], [], [])
                continue
            if starts is None:
                starts = batch.token_starts()
            first = starts[row]
            parts = []
            for offset in range(0, end - start, PROMPT_LOGPROBS_ROWS):  # bounded logits memory
                count = min(PROMPT_LOGPROBS_ROWS, end - start - offset)
                logits = self.model.compute_logits(hidden[first + offset : first + offset + count])
                targets = state.prompt_token_ids[start + offset + 1 : start + offset + count + 1]
                parts.append(compute_logprobs(logits, torch.tensor(targets, device=self.device), k))
            tensors = parts[0] if len(parts) == 1 else LogprobsTensors(
                *(torch.cat([getattr(part, name) for part in parts]) for name in ("token_ids", "logprobs", "ranks"))
            )
            results[state.req_id] = _to_request_logprobs(tensors, slice(None), k)
        return results


def profile_states(config: EngineConfig, vocab_size: int) -> tuple[list[CachedRequestState], list[int]]:
    """Dummy requests shaped like the largest step ``config`` allows: ``max_num_batched_tokens``
    prompt tokens (as many as ``max_num_seqs`` sequences of ``max_model_len`` hold) over
    ``min(max_num_seqs, tokens)`` sequences, every one sampling with truncation, penalties
    and ``max_logprobs``."""
    # a step holds at most max_num_seqs sequences, none longer than max_model_len
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    num_seqs = max(1, min(config.max_num_seqs, num_tokens), -(-num_tokens // config.max_model_len))
    lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.1,
        presence_penalty=0.1, logprobs=config.max_logprobs, max_tokens=1,
    )
    states = []
    for i, length in enumerate(lengths):
        prompt = [(i + j) % vocab_size for j in range(length)]
        sampling = RequestSamplingState(params=params, prompt_token_ids=prompt, output_token_ids=[], generator=None, eos_token_ids=[])
        states.append(CachedRequestState(req_id=f"profile-{i}", prompt_token_ids=prompt, num_computed_tokens=0, sampling=sampling))
    return states, lengths


def profile_step_peak_bytes(runner: ModelRunner, platform: type, states: list[CachedRequestState], num_scheduled: list[int]) -> int:
    """Run one step of ``states`` (prefills from position 0) on a scratch KV cache, sampling
    every sequence and computing one chunk of prompt logprobs, and return the device memory it
    took above what was allocated before it (the scratch cache not counted)."""
    model = runner.model
    block_size = runner.block_size
    num_blocks = sum(-(-n // block_size) for n in num_scheduled)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    scratch = [runner._zeros(shape) for _ in range(model.num_layers)]
    next_block = 0
    for state, n in zip(states, num_scheduled):
        count = -(-n // block_size)
        runner.block_table.add(state.req_id, list(range(next_block, next_block + count)))
        next_block += count
    platform.synchronize()
    platform.release_cached_memory()  # measured from what live tensors hold, nothing cached
    baseline = platform.allocated_memory_bytes()
    platform.reset_peak_memory()
    try:
        with torch.inference_mode():
            batch = runner.build_batch(states, num_scheduled)
            if runner.backend_cls is not None:
                runner.backend_cls.prepare_metadata(batch.attn_metadata)
            ctx = ForwardContext(batch.attn_metadata, scratch)
            stage = runner.stage
            if stage.is_single:
                hidden = model(batch.input_ids, batch.positions, ctx)
            else:  # a pipeline stage alone: zeros stand in for the previous stage's output
                intermediate = None
                if not stage.is_first:
                    shape = (batch.positions.shape[0], runner.model_config.hf_config.hidden_size)
                    zeros = torch.zeros(shape, dtype=runner.model_config.dtype, device=runner.device)
                    intermediate = IntermediateTensors(zeros, zeros.clone())
                hidden = model(batch.input_ids, batch.positions, ctx, intermediate)
                if not stage.is_last:  # no logits here
                    platform.synchronize()
                    return max(0, platform.peak_memory_bytes() - baseline)
            logits = model.compute_logits(hidden[batch.logits_indices])
            meta = SamplingMetadata.build([s.sampling for s in batch.states], logits.shape[-1], runner.device)
            runner.sampler(logits, meta)
            del logits, meta
            rows = min(PROMPT_LOGPROBS_ROWS, hidden.shape[0])
            prompt_logits = model.compute_logits(hidden[:rows])
            targets = batch.input_ids[:rows]
            compute_logprobs(prompt_logits, targets, runner.config.max_logprobs)
        platform.synchronize()
        return max(0, platform.peak_memory_bytes() - baseline)
    finally:
        for state in states:
            runner.block_table.remove(state.req_id)
        del scratch


def profile_peak_bytes(runner: ModelRunner, platform: type) -> int:
    """The device memory the largest step the configuration allows needs above the weights."""
    states, lengths = profile_states(runner.config, runner.model_config.vocab_size)
    return profile_step_peak_bytes(runner, platform, states, lengths)


def _to_host(logprobs: LogprobsTensors) -> LogprobsTensors:
    """Queue the copy of a step's logprobs to the host (read after the step's one sync)."""
    return LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in (logprobs.token_ids, logprobs.logprobs, logprobs.ranks)))
