"""Continuous batching under a token budget, chunked prefill mixed with decodes, preemption
by recompute when KV blocks run out."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass

from sonar.config import SchedulerConfig
from sonar.engine.kv_cache import KVCacheManager
from sonar.engine.request import Request, RequestStatus
from sonar.engine.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from sonar.engine.scheduling_policy import FcfsPolicy, SchedulingPolicy
from sonar.kv_transfer.interface import KVConnector, KVConnectorOutput
from sonar.spec_decode.stats import SpecDecodeStats
from sonar.spec_decode.verification import ConfidenceVerification

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Scheduled:
    """What scheduling one running request this step changed, to undo it if it is preempted
    later in the same step."""

    request: Request
    num_new: int
    num_prompt_tokens: int
    samples: bool


class Scheduler:
    """Running requests are served first, in admission order; when a running request needs a
    block and none is free, the policy's victim is preempted (its blocks freed, to be
    recomputed later, mostly from the prefix cache). Waiting requests are then admitted in the
    policy's order (first come, first served by default; ``priority``: lower values first).

    A request's ``num_computed_tokens`` advances when it is scheduled, so the next step can be
    scheduled before this one's results are back (asynchronous scheduling): a token scheduled
    to be sampled counts in ``num_pending_tokens`` until ``update_from_output`` brings its
    value, and the next step feeds it to the model from the device. A request whose tokens are
    not all known is never prefilled again (after a preemption) until they are, and one that
    reaches ``max_tokens`` with its pending token is not scheduled again.

    With a KV connector, a waiting request's tokens that exist outside (host memory, another
    engine) are loaded instead of computed: synchronously within the step that admits it, or
    asynchronously, the request then holding its blocks outside the queues until the
    connector reports the load done (or failed: the tokens are computed instead). A finished
    request whose blocks a peer still reads keeps them until the connector reports the send.

    Speculative decoding: a decoding request's drafts ride along with its decode. With
    ``verification`` set (a ``ConfidenceVerification``: confidence-scheduled verification),
    each step first chooses how many of every request's drafts are worth verifying, given the
    step's other tokens, and whether the proposer drafts after the step; without it every
    draft is verified while the batch is within ``disable_by_batch_size``.

    Pipeline parallelism (``pipeline_parallel_size`` > 1): several steps are in flight at once,
    and a request with a step in flight is not scheduled again until its results are back
    (``in_flight``), and each step takes at most a ``1 / pipeline_parallel_size`` share of the
    requests (so that many micro-batches keep every stage busy); the output tokens the workers
    of the earlier stages have not seen travel in the step's ``CachedRequestData.new_token_ids``,
    since only the last stage samples.

    LoRA (``max_loras`` > 0): the running requests never use more than ``max_loras`` distinct
    adapters (the device slots), so no step needs more; a waiting request of another adapter
    waits, and the requests queued behind it are admitted past it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        policy: SchedulingPolicy | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy or FcfsPolicy()
        self.connector = connector
        if connector is not None:
            kv_cache.on_evict = connector.on_block_evicted
        self._loading: dict[str, tuple[Request, int]] = {}  # async loads: request, tokens computed once loaded
        self._loaded: list[Request] = []  # their KV arrived: admitted before the waiting queue
        self._sending: dict[str, Request] = {}  # finished; blocks held until the connector's send ends
        self.num_external_queries = 0  # prompt tokens of admitted requests looked up by the connector
        self.num_external_hits = 0  # of them, tokens the connector loaded
        self.num_kv_load_failures = 0  # asynchronous loads that failed (their tokens were computed)
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.new_waiting_queue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._sent_blocks: dict[str, int] = {}  # block ids already sent to the workers
        self.spec_stats = SpecDecodeStats()
        self.verification: ConfidenceVerification | None = None  # None: fixed verification
        self.num_requests_of_lora: Counter[int] = Counter()  # adapter id -> its unfinished requests
        self.num_running_of_lora: Counter[int] = Counter()  # adapter id -> its running requests
        # pipeline parallelism: requests with a step in flight, and the output tokens sent per request
        self.in_flight: set[str] | None = set() if config.pipeline_parallel_size > 1 else None
        self._sent_outputs: dict[str, int] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request; it is admitted by a later ``schedule()``."""
        self.requests[request.request_id] = request
        if request.lora_int_id:
            self.num_requests_of_lora[request.lora_int_id] += 1
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks now; unknown or already
        finished ids are ignored. Returns the requests aborted."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.status = RequestStatus.FINISHED_ABORTED
            self._finish(request)
            aborted.append(request)
        return aborted

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish a request from outside the step (a stop string found by the detokenizer)."""
        if not request.is_finished:
            request.status = status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        req_id = request.request_id
        if request.lora_int_id and self.requests.get(req_id) is request:
            self._count_lora(self.num_requests_of_lora, request, -1)
        if request in self.running:
            self.running.remove(request)
            self._count_lora(self.num_running_of_lora, request, -1)
        elif request in self._loaded:
            self._loaded.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._sent_blocks.pop(req_id, None)
        self.requests.pop(req_id, None)
        self.finished_req_ids.add(req_id)
        if self.in_flight is not None:
            self.in_flight.discard(req_id)
            self._sent_outputs.pop(req_id, None)
        if req_id in self._loading:  # its blocks are being written: freed once the load ends
            return
        delay = False
        if self.connector is not None:
            delay, request.kv_transfer_params = self.connector.request_finished(request, self.kv_cache.block_ids(req_id))
        if delay:
            self._sending[req_id] = request
        else:
            self.kv_cache.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self._loaded) + sum(not r.is_finished for r, _ in self._loading.values())

    @property
    def has_pending_transfers(self) -> bool:
        """Whether the connector still moves blocks that requests hold (the engine keeps
        stepping, to hear when it is done), or has copies queued for the worker."""
        return bool(self._loading or self._sending) or (self.connector is not None and self.connector.has_pending_work)

    def update_finished_transfers(self, output: KVConnectorOutput | None) -> None:
        """Free the blocks of finished sends; admit the requests whose loads ended (a failed
        one computes the tokens it was to load)."""
        if output is None:
            return
        for req_id in output.finished_sending:
            request = self._sending.pop(req_id, None)
            if request is not None:
                self.kv_cache.free(request)
        for req_id in output.finished_recving:
            entry = self._loading.pop(req_id, None)
            if entry is None:
                continue
            request, num_loaded = entry
            if request.is_finished:  # aborted while loading
                self.kv_cache.free(request)
                continue
            if req_id in output.failed_recving:
                self.num_kv_load_failures += 1
                logger.warning("request %s: loading its KV failed; its prompt is computed here instead", req_id)
            else:
                self.num_external_hits += num_loaded - request.num_computed_tokens
                request.num_computed_tokens = request.num_cached_tokens = num_loaded
            request.status = RequestStatus.WAITING
            self._loaded.append(request)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work: every running request's next tokens (a decode, or the next
        chunk of its prefill) in admission order, preempting the policy's victim when blocks
        run out; then waiting requests in the policy's order while the token budget, the
        sequence cap and the free blocks allow (their prompts chunked to fit the budget, or, with
        chunked prefill off, admitted only where they fit it whole)."""
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        if self.connector is not None:  # what this step hashes is not computed yet: never offloaded
            self.kv_cache.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, _Scheduled] = {}
        plan = None
        in_flight = self.in_flight
        step_cap = self._micro_batch_cap() if in_flight is not None else 0
        if self.verification is not None:
            plan, num_sampling, base_tokens = self._plan_verification(budget)
            out.propose_drafts = self.verification.worth_drafting(num_sampling, base_tokens)

        # running: decodes and unfinished prefill chunks
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if in_flight is not None and (request.request_id in in_flight or len(out.num_scheduled_tokens) >= step_cap):
                index += 1  # its step is still in the pipeline, or this micro-batch is full
                continue
            pending = request.num_pending_tokens
            if pending and request.num_output_tokens + pending >= request.max_tokens:
                index += 1  # its last token is on the way: it finishes when that arrives
                continue
            num_new = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts:  # speculative decoding: the drafts ride along with the decode
                drafts = self._drafts_to_verify(request, num_new, budget, plan)
            pass_rows = self._pass_rows(request, num_new, len(drafts), budget, in_flight) if out.propose_drafts else 0
            num_new += len(drafts) + pass_rows
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.policy.select_victim(self.running)
                position = self.running.index(victim)
                self.running.pop(position)
                if victim.request_id in scheduled:  # scheduled earlier this step: undone
                    budget += self._unschedule(scheduled.pop(victim.request_id), out)
                if position < index:
                    index -= 1
                self._preempt(victim)
                out.finished_req_ids.add(victim.request_id)
                out.preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            else:
                out.cached_reqs.append(
                    CachedRequestData(
                        request.request_id, self._new_block_ids(request), request.num_computed_tokens,
                        self._new_token_ids(request) if in_flight is not None else [],
                    )
                )
                if drafts:
                    out.scheduled_spec_decode_tokens[request.request_id] = drafts
                if pass_rows:
                    out.spec_pass_rows[request.request_id] = pass_rows
                scheduled[request.request_id] = self._advance(request, num_new, out, len(drafts) + pass_rows)
                budget -= num_new
                index += 1
            # else the request preempted itself; the next one (now at index) goes on

        # loaded: requests whose external KV arrived, holding their blocks already
        while self._loaded and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._loaded[0]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break  # its rest does not fit this step whole
            if not self._lora_fits(request) or not self.kv_cache.allocate_slots(request, num_new):
                break
            self._loaded.pop(0)
            self._admit(request, request.num_computed_tokens, num_new, out)
            budget -= num_new

        # waiting: new and preempted requests, in the policy's order
        passed_over: list[Request] = []  # of adapters the running requests leave no slot for
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if in_flight is not None and (request.request_id in in_flight or len(out.num_scheduled_tokens) >= step_cap):
                break  # preempted with a step on the way (prefilled again once it is back), or a full micro-batch
            if request.num_pending_tokens:
                break  # preempted with a token on the way: prefilled again once it is known
            if not self._lora_fits(request):
                passed_over.append(self.waiting.pop())
                continue
            computed_blocks, num_cached = ([], 0)
            num_external, load_async = 0, False
            first_lookup = request.num_computed_tokens == 0
            if first_lookup:
                computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
                if self.connector is not None:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_cached)
                    num_external = max(0, min(num_external, request.num_tokens - 1 - num_cached))  # one token computes logits
                    load_async = load_async and num_external > 0
            remaining = request.num_tokens - num_cached - num_external
            num_new = 0 if load_async else min(remaining, budget)
            if not self.config.enable_chunked_prefill and not load_async and num_new < remaining:
                break  # its prompt does not fit this step whole: it waits for the next
            if not self.kv_cache.allocate_slots(request, num_new + num_external, computed_blocks):
                break
            self.waiting.pop()
            if first_lookup and self.kv_cache.enable_prefix_caching:
                self.kv_cache.record_lookup(request.num_tokens, num_cached)
            if self.connector is not None:
                if first_lookup:
                    self.num_external_queries += request.num_tokens
                self.connector.update_state_after_alloc(request, self.kv_cache.block_ids(request.request_id), num_external)
            if load_async:  # holds its blocks, out of the queues, until the connector has filled them
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                self.kv_cache.uncache_blocks(request, num_cached // self.kv_cache.block_size)
                self._loading[request.request_id] = (request, num_cached + num_external)
                continue
            self.num_external_hits += num_external
            self._admit(request, num_cached + num_external, num_new, out)
            budget -= num_new
        for request in reversed(passed_over):  # back at the head, in their order
            self.waiting.add_preempted(request)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if in_flight is not None:
            in_flight.update(out.num_scheduled_tokens)
        if self.verification is not None and out.propose_drafts:  # the batch is known now, admissions in it
            out.draft_limit = self.verification.draft_limit_for(len(self.running))
            if out.draft_limit == 0:  # drafts would not pay at this batch: the step does not draft
                out.propose_drafts, out.draft_limit = False, None
        return out

    def _admit(self, request: Request, num_computed: int, num_new: int, out: SchedulerOutput) -> None:
        """Start running a request whose first ``num_computed`` tokens are in its blocks, with
        ``num_new`` more scheduled this step."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._count_lora(self.num_running_of_lora, request, 1)
        out.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                block_ids=self.kv_cache.block_ids(request.request_id),
                num_computed_tokens=num_computed,
                lora_int_id=request.lora_int_id,
            )
        )
        self._sent_blocks[request.request_id] = len(out.new_reqs[-1].block_ids)
        if self.in_flight is not None:
            self._sent_outputs[request.request_id] = request.num_output_tokens
        self._advance(request, num_new, out)

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int, plan: dict[str, int] | None = None) -> list[int]:
        """The drafts a decoding request verifies this step: none unless it decodes its one
        known token, the batch is small enough, and budget and ``max_tokens`` leave room; no
        more than ``plan`` gives it, where the verification policy made one."""
        if num_new != 1 or request.num_pending_tokens or len(self.running) > self.config.spec_max_batch_size:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        if plan is not None:
            room = min(room, plan.get(request.request_id, 0))
        return request.spec_token_ids[:room] if room > 0 else []

    def _pass_rows(self, request: Request, num_new: int, num_drafts: int, budget: int, in_flight: set[str] | None) -> int:
        """Rows for the further verify passes of this step (``verify_passes``; 0: one pass):
        only for a request decoding its one known token (with drafts or none: a first pass
        without drafts is a plain decode) that runs alone, nothing waiting to be admitted,
        whose sampling the worker can verify pass after pass (greedy; no logprobs, no
        penalties or other reads of its earlier tokens, no grammar), within the budget,
        ``max_tokens``, the model's length and the free KV blocks (rows for passes never
        preempt); and only in a step that drafts (the scheduler's caller checks: where the
        verification policy finds drafting does not pay, the passes would have no drafts)."""
        rows = self.config.spec_pass_rows
        if not rows or num_new != 1 or request.num_pending_tokens or in_flight is not None:
            return 0
        if len(self.running) != 1 or self.waiting or self._loaded:
            return 0
        params = request.sampling_params
        if not params.greedy or params.logprobs is not None or request.reads_output_tokens:
            return 0
        emitted = num_drafts + 1  # the most this step's first pass emits
        room = min(
            budget - emitted,
            request.max_tokens - request.num_output_tokens - emitted,
            self.config.max_model_len - request.num_computed_tokens - emitted,
            self.kv_cache.num_tokens_fitting(request.request_id) - request.num_computed_tokens - emitted,
        )
        return max(0, min(rows, room))

    def _plan_verification(self, budget: int) -> tuple[dict[str, int], int, int]:
        """Confidence-scheduled verification: the drafts each running request may verify this
        step, chosen by the policy; also the step's decodes and its tokens besides drafts
        (the running requests' next tokens, then the prefill the budget left over would
        admit from the waiting queue), which say whether the next step is worth drafting."""
        candidates: list[Request] = []
        confidences: list[list[float] | None] = []
        rooms: list[int] = []
        base_tokens = num_sampling = 0
        speculates = len(self.running) <= self.config.spec_max_batch_size
        for request in self.running:
            pending = request.num_pending_tokens
            if pending and request.num_output_tokens + pending >= request.max_tokens:
                continue  # scheduled nothing this step
            num_new = request.num_tokens + pending - request.num_computed_tokens
            base_tokens += num_new
            if num_new != 1:
                continue  # a prefill chunk
            num_sampling += 1
            drafts = request.spec_token_ids
            if drafts and speculates and not pending:
                room = min(len(drafts), request.max_tokens - request.num_output_tokens - 1)
                if room > 0:
                    candidates.append(request)
                    confidences.append(request.spec_confidence)
                    rooms.append(room)
        base_tokens = min(base_tokens, budget)
        max_drafts = budget - base_tokens
        # the prefill the rest of the budget admits (drafts are scheduled before it)
        seats = self.config.max_num_seqs - len(self.running)
        waiting = 0
        for request in itertools.chain(self._loaded, self.waiting):
            if waiting >= max_drafts or seats <= 0 or request.num_pending_tokens:
                break
            waiting += request.num_tokens - request.num_computed_tokens
            seats -= 1
        base_tokens += min(waiting, max_drafts)
        plan: dict[str, int] = {}
        if candidates:
            lengths = self.verification.choose(confidences, rooms, num_sampling, base_tokens, max_drafts)
            plan = {request.request_id: length for request, length in zip(candidates, lengths)}
        return plan, num_sampling, base_tokens

    @staticmethod
    def _advance(request: Request, num_new: int, out: SchedulerOutput, num_drafts: int = 0) -> _Scheduled:
        """Count ``num_new`` scheduled tokens (``num_drafts`` of them drafts) as computed; one
        that completes the known tokens samples the next, which stays pending until its value
        comes back."""
        computed = request.num_computed_tokens
        num_prompt_left = request.num_prompt_tokens - computed
        num_prompt = 0 if num_prompt_left <= 0 else min(num_new, num_prompt_left)
        req_id = request.request_id
        out.num_scheduled_tokens[req_id] = num_new
        out.num_prompt_tokens += num_prompt
        if request.reads_output_tokens:
            out.reads_output_tokens = True
        request.num_computed_tokens = computed = computed + num_new
        samples = computed - num_drafts == request.num_tokens + request.num_pending_tokens
        if samples:
            request.num_pending_tokens += 1
            out.sampling_req_ids.append(req_id)
        return _Scheduled(request, num_new, num_prompt, samples)

    @staticmethod
    def _unschedule(entry: _Scheduled, out: SchedulerOutput) -> int:
        """Take a running request back out of this step (it is being preempted); returns the
        tokens it gives back to the budget."""
        request = entry.request
        del out.num_scheduled_tokens[request.request_id]
        out.scheduled_spec_decode_tokens.pop(request.request_id, None)
        out.spec_pass_rows.pop(request.request_id, None)
        out.cached_reqs = [c for c in out.cached_reqs if c.req_id != request.request_id]
        out.num_prompt_tokens -= entry.num_prompt_tokens
        if entry.samples:
            request.num_pending_tokens -= 1
            out.sampling_req_ids.remove(request.request_id)
        return entry.num_new

    def _new_block_ids(self, request: Request) -> list[int]:
        sent = self._sent_blocks.get(request.request_id, 0)
        new_ids = self.kv_cache.block_ids(request.request_id, start=sent)
        self._sent_blocks[request.request_id] = sent + len(new_ids)
        return new_ids

    def _micro_batch_cap(self) -> int:
        """Pipeline parallelism: the most requests one step takes, an even share of those that
        run or wait (up to ``max_num_seqs``) over the stages."""
        num_active = min(len(self.running) + len(self.waiting) + len(self._loaded), self.config.max_num_seqs)
        return max(1, -(-num_active // self.config.pipeline_parallel_size))

    def _new_token_ids(self, request: Request) -> list[int]:
        """The output tokens the workers have not been sent yet (pipeline parallelism: the
        stages before the last do not sample, so they learn the tokens from here)."""
        sent = self._sent_outputs.get(request.request_id, request.num_output_tokens)
        self._sent_outputs[request.request_id] = request.num_output_tokens
        return request.output_token_ids[sent:]

    def _lora_fits(self, request: Request) -> bool:
        """Whether admitting ``request`` keeps the running requests within ``max_loras``
        adapters."""
        lora_int_id = request.lora_int_id
        running = self.num_running_of_lora
        return not lora_int_id or lora_int_id in running or len(running) < self.config.max_loras

    @staticmethod
    def _count_lora(counts: Counter[int], request: Request, delta: int) -> None:
        lora_int_id = request.lora_int_id
        if not lora_int_id:
            return
        counts[lora_int_id] += delta
        if counts[lora_int_id] <= 0:
            del counts[lora_int_id]

    def _preempt(self, request: Request) -> None:
        self._count_lora(self.num_running_of_lora, request, -1)
        self.kv_cache.free(request)
        self._sent_blocks.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_confidence = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    # -- results -------------------------------------------------------------------------

    def update_from_output(self, scheduled: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Append the step's sampled tokens and finish the requests that hit eos, a stop token
        or their length. A request finished or aborted while the step ran is skipped (the
        token it computed meanwhile is dropped)."""
        self.update_finished_transfers(output.kv_connector_output)
        if self.in_flight is not None:
            self.in_flight.difference_update(scheduled.num_scheduled_tokens)
        if self.verification is not None and output.draft_seconds:
            self.verification.observe_drafting(output.draft_seconds, output.draft_rows)
        verified = output.verified_token_ids
        for req_id, token_id in zip(output.req_ids, output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished or token_id is None:
                continue  # gone, or a prefill chunk that sampled nothing
            request.num_pending_tokens -= 1
            pass_rows = scheduled.spec_pass_rows.get(req_id, 0)
            if (verified and req_id in verified) or pass_rows:  # a step of passes may have emitted one token
                self._append_verified(
                    request, scheduled.scheduled_spec_decode_tokens.get(req_id, []), verified.get(req_id, [token_id]),
                    pass_rows, output.verified_passes.get(req_id, ()),
                )
                if request.is_finished:
                    self._finish(request)
                    continue
            else:
                request.output_token_ids.append(token_id)
                if request.check_stop():
                    self._finish(request)
                    continue
            if self.config.spec_max_batch_size:  # speculation on: fresh drafts, or none
                drafts = output.draft_token_ids.get(req_id, [])
                request.spec_token_ids = drafts
                request.spec_confidence = output.draft_confidence.get(req_id) if drafts else None
                self.spec_stats.num_proposed_tokens += len(drafts)

    def _append_verified(self, request: Request, drafts: list[int], token_ids: list[int], pass_rows: int = 0, passes=()) -> None:
        """Append a verify step's tokens up to the first that stops the request, and take the
        rejected drafts' positions back (their KV is overwritten by the next step); with
        further passes (``pass_rows`` scheduled for them), the rows they did not keep too.
        ``passes``: a step of several passes' ``[drafts, kept]`` each, for the acceptance
        counts (the drafts of those after the first were proposed in the worker)."""
        request.num_computed_tokens -= len(drafts) + pass_rows - (len(token_ids) - 1)
        for index, (num_drafts, kept) in enumerate(passes or [(len(drafts), len(token_ids) - 1)]):
            if index:
                self.spec_stats.num_proposed_tokens += num_drafts
            self.spec_stats.observe(num_drafts, kept)
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            if request.check_stop():
                return
