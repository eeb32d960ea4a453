"""What a model runner does for speculative decoding: verify a step's drafts against its
logits, and ask the proposer for the next step's drafts once the step's tokens are known."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sonar import ops
from sonar.registry import load_registered, speculative_proposers
from sonar.sampler.logprobs import LogprobsTensors, compute_logprobs
from sonar.sampler.metadata import RequestSamplingState, SamplingMetadata
from sonar.sampler.sampler import Sampler
from sonar.spec_decode.draft_probs import DraftProbsStore
from sonar.spec_decode.eligibility import may_ever_speculate, may_speculate
from sonar.spec_decode.hidden_states import HiddenStateCollector, StepHiddenStates
from sonar.spec_decode.interface import ChainedDrafts, ChainedStep, DraftCacheBudget, Proposer, ProposerInputs, SpeculativeConfig
from sonar.spec_decode.verifier import VerifyLayout, VerifyResult, leading_accepted, verify
from sonar.tensors import to_device
from sonar.worker.input_batch import StepBatch

if TYPE_CHECKING:
    from sonar.engine.scheduler_output import ModelRunnerOutput
    from sonar.worker.input_batch import CachedRequestState
    from sonar.worker.model_runner import ModelRunner


class TokenSequence(Sequence[int]):
    """A request's prompt and output read as one sequence, without copying either."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self.prompt)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.prompt[index] if index < n else self.output[index - n]


class RequestSequences(Sequence[tuple[list[int], list[int], RequestSamplingState]]):
    """Each request's prompt, output so far and sampling state, as ``propose`` and
    ``keep_context`` take them, read from the runner's request states when asked for."""

    __slots__ = ("states",)

    def __init__(self, states: list[CachedRequestState]) -> None:
        self.states = states

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        state = self.states[index]
        return state.prompt_token_ids, state.output_token_ids, state.sampling


@dataclass(slots=True)
class ChainedProposal:
    """Drafts queued right behind a verify step (``SpeculativeDecoder.chain``): their host
    copies (valid once the step's results are), and how long the host took to queue them."""

    req_ids: list[str]  # the requests that draft, in order
    token_ids: torch.Tensor  # [B, k]
    confidence: torch.Tensor | None
    seconds: float
    on_device: torch.Tensor | None = None  # token_ids where the drafter wrote them
    # tokens the step emitted before the pass these drafts follow (verify passes read back
    # one by one: each pass's drafts are settled on that pass's tokens alone)
    num_earlier: int = 0


@dataclass(slots=True)
class VerifiedStep:
    """A verify step's results on the device: the emitted tokens per position, the drafts
    kept per request, and the logprobs of every position (when some request asked)."""

    layout: VerifyLayout
    result: VerifyResult
    logprobs: LogprobsTensors | None


class SpeculativeDecoder:
    """The runner's speculative part: the configured proposer and the verifier."""

    chain_drafts = True  # a proposer that chains drafts behind verification where a step allows

    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        proposer_cls = load_registered("speculative proposer", config.method, speculative_proposers())
        self.proposer: Proposer = proposer_cls(config, device)
        self.hidden = HiddenStateCollector() if self.proposer.needs_hidden_states else None
        self._aux_states = None  # the target's auxiliary hidden states, where it keeps them
        self.draft_probs = DraftProbsStore()  # the proposer's distributions, until verified
        self._live: dict[str, Any] | None = None  # the runner's requests, where one owns this
        self._eligible: set[str] = set()  # requests whose parameters allow drafts at some point
        self._ineligible: set[str] = set()  # requests whose parameters never do
        self.drafted_rows = 0  # requests the last proposal drafted for

    def load_model(self, target_model: torch.nn.Module, runner: ModelRunner | None = None) -> None:
        if runner is not None:
            self.proposer.bind_runner(runner)
            self._live = runner.requests  # the requests the worker still runs
        self.proposer.load_model(target_model)
        self._aux_states = getattr(target_model, "aux_hidden_states", None)

    def cache_bytes_per_block(self, block_size: int) -> int:
        """The proposer's own cache bytes per target block (0: it keeps none)."""
        return self.proposer.cache_bytes_per_block(block_size)

    def init_cache(self, budget: DraftCacheBudget) -> None:
        """Size the proposer's own cache from the target's (and capture its passes)."""
        self.proposer.init_cache(budget)

    def remove_requests(self, req_ids: set[str]) -> None:
        self.proposer.remove_requests(req_ids)
        self._eligible.difference_update(req_ids)
        self._ineligible.difference_update(req_ids)
        if self.hidden is not None:
            self.hidden.remove_requests(req_ids)
        self.draft_probs.remove(req_ids)

    def phase_targets(self) -> list[tuple[object, str, str]]:
        """The speculative parts of a step a benchmark may time (see ``ModelRunner.phase_targets``):
        verification (launched with the step), the proposal once the step's tokens are read
        back, with the host's wait for the drafter's results in it, and after a step without
        drafts the hand-over of its states to a drafter's context."""
        targets: list[tuple[object, str, str]] = [
            (self, "verify", "launch: spec_verify"),
            (self, "propose", "fetch: spec_propose"),
            (self.proposer, "propose", "fetch: spec_propose: proposer"),
            (self, "keep_context", "fetch: spec_keep_context"),
            (self.proposer, "keep_context", "fetch: spec_keep_context: proposer"),
        ]
        if self.hidden is not None:
            targets += [(self, "record_hidden_states", "launch: spec_hidden_states"), (self.hidden, "gather", "fetch: spec_propose: gather_states")]
        return targets

    def record_hidden_states(self, batch: StepBatch, final_hidden: torch.Tensor) -> StepHiddenStates:
        """Keep a step's states for the proposer (one that ``needs_hidden_states``): the
        target's auxiliary states where the proposer chose layers, else its final ones."""
        aux = self._aux_states
        states = aux.latest if aux is not None and aux.layer_ids else final_hidden
        # a copy: a decode step replayed from a CUDA graph leaves its states in the graph's
        # buffers, which the next replay overwrites, possibly before this step's proposal
        return self.hidden.record(batch, states.clone())

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        states: list[RequestSamplingState],
        drafts: list[list[int]],
        req_ids: list[str] | None = None,
    ) -> VerifiedStep:
        """Verify ``drafts[i]`` of request ``states[i]`` (``req_ids[i]``: where given, the
        distributions the proposer drew them from are used): ``logits`` holds, per request,
        one row per draft and one for its bonus position, in request order."""
        layout = VerifyLayout.build(drafts, logits.device)
        positions = [state for state, tokens in zip(states, drafts) for _ in range(len(tokens) + 1)]
        meta = SamplingMetadata.build(positions, logits.shape[-1], logits.device)
        processed = sampler.process(logits, meta)
        greedy_ids = None if meta.all_random else ops.argmax(processed)
        if meta.all_greedy:  # the argmax is the emitted token everywhere; the host counts the kept drafts
            return VerifiedStep(layout, VerifyResult(greedy_ids, None), self._logprobs(logits, greedy_ids, meta))
        probs = sampler.final_probabilities(processed, meta)
        greedy_rows = None
        if not meta.all_random:  # a batch of both kinds (an all-greedy one returned above)
            greedy_rows = to_device(torch.tensor([s.params.greedy for s in states]), logits.device)
        generators = {
            row: state.generator for row, state in enumerate(states) if state.generator is not None and not state.params.greedy
        }
        draft_probs = None
        if req_ids is not None and self.draft_probs:
            draft_probs = self.draft_probs.take_rows(req_ids, drafts, layout, logits.shape[-1])
        result = verify(probs, greedy_ids, greedy_rows, layout, generators, draft_probs)
        return VerifiedStep(layout, result, self._logprobs(logits, result.token_ids, meta))

    def chain(
        self,
        verified: VerifiedStep,
        hidden: StepHiddenStates | None,
        req_ids: list[str],
        states: list[CachedRequestState],
        num_requests: int,
        draft_limit: int | None,
    ) -> ChainedProposal | None:
        """Queue the next step's drafts right behind a verify step (a proposer that
        ``chains``), so that one read-back brings the step's tokens and the drafts together;
        None where the step does not allow it and the proposal waits for the tokens as usual.

        It allows it when the step (``num_requests`` scheduled, the sampled ``req_ids[i]``
        with state ``states[i]``, launched and not yet advanced) is all decoding, and every
        request that may ever draft verified drafts now and may draft again after this step
        (not short of ``min_tokens``), with none left out by ``draft_limit`` and no earlier
        states waiting for a hand-over. The others (parameters that never draft) take no part.
        ``verified.result.num_accepted`` is then set where the host would count it."""
        proposer, layout = self.proposer, verified.layout
        if not (self.chain_drafts and proposer.chains and hidden is not None) or num_requests != len(req_ids):
            return None
        if num_requests > self.config.max_batch_size or self.hidden.has_waiting or hidden.req_ids != req_ids:
            return None
        if hidden.starts.tolist() != layout.starts or (hidden.counts != np.asarray(layout.num_drafts) + 1).any():
            return None  # not a decoding step: its states' rows are not its verified positions
        rows = []
        for i, state in enumerate(states):
            params = state.sampling.params
            if not may_ever_speculate(params):
                continue
            if not layout.num_drafts[i] or not may_speculate(params, len(state.sampling.output_token_ids) + 1):
                return None
            if self._live is not None and state.req_id not in self._live:
                return None
            rows.append(i)
        if not rows or (draft_limit is not None and draft_limit < len(rows)):
            return None
        started = time.perf_counter()
        result = verified.result
        if result.num_accepted is None:  # an all-greedy batch: counted here instead of on the host
            result.num_accepted = leading_accepted((result.token_ids == layout.draft_ids) & (layout.draft_ids >= 0), layout)
        counts = [layout.num_drafts[i] + 1 for i in rows]
        starts = [layout.starts[i] for i in rows]
        states_rows, positions, accepted = hidden.states, hidden.positions, result.num_accepted
        if len(rows) < len(req_ids):  # the drafting requests' rows only
            index = to_device(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)]), self.device)
            states_rows, positions = states_rows.index_select(0, index), positions.index_select(0, index)
            accepted = accepted[to_device(np.asarray(rows, dtype=np.int64), self.device)]
        step = ChainedStep(
            req_ids=[req_ids[i] for i in rows],
            num_positions=counts,
            starts=starts,
            first_positions=[states[i].num_computed_tokens for i in rows],
            token_ids=result.token_ids,
            num_accepted=accepted,
            hidden_states=states_rows,
            positions=positions,
        )
        drafts: ChainedDrafts = proposer.propose_chained(step)
        limit = self.config.num_speculative_tokens
        confidence = None if drafts.confidence is None else drafts.confidence[:, :limit].to("cpu", non_blocking=True)
        token_ids = drafts.token_ids[:, :limit]
        return ChainedProposal(step.req_ids, token_ids.to("cpu", non_blocking=True), confidence, time.perf_counter() - started, token_ids)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> LogprobsTensors | None:
        if meta.max_num_logprobs is None:
            return None
        return compute_logprobs(logits, token_ids, meta.max_num_logprobs)

    def after_step(
        self,
        output: ModelRunnerOutput,
        req_ids: list[str],
        states: list[CachedRequestState],
        hidden: StepHiddenStates | None,
        drafting: bool,
        draft_limit: int | None,
        chained: ChainedProposal | None = None,
    ) -> None:
        """Once a step's tokens are known (``output``; ``states[i]`` request ``req_ids[i]``'s
        state): where ``drafting``, the next step's drafts into ``output`` with how long they
        took and for how many requests; else, for a proposer that ``keeps_context``, the
        step's states into the drafter's context. A step whose drafts were ``chained`` behind
        it hands them over instead."""
        if chained is not None:
            self._take_chained(output, chained)
            return
        if not drafting and not self.proposer.keeps_context:
            return
        verified = output.verified_token_ids
        num_accepted = [len(verified.get(r, ())) or 1 for r in req_ids] if verified else [1] * len(req_ids)
        sequences = RequestSequences(states)
        if not drafting:  # most steps of a loaded engine: the sequences are read only at a hand-over
            self.keep_context(req_ids, sequences, num_accepted, hidden)
            return
        started = time.perf_counter()  # the drafts are read back: the device's drafting is in it
        output.draft_token_ids, output.draft_confidence = self.propose(req_ids, sequences, num_accepted, hidden, draft_limit)
        output.draft_seconds = time.perf_counter() - started
        output.draft_rows = self.drafted_rows

    def _take_chained(self, output: ModelRunnerOutput, chained: ChainedProposal) -> None:
        """A chained step's drafts (read back with its tokens) into ``output``, the proposer's
        host state settled on its kept drafts."""
        req_ids = chained.req_ids
        self.proposer.settle_chained(req_ids, [len(output.verified_token_ids[r]) - 1 - chained.num_earlier for r in req_ids])
        survival = chained.confidence.tolist() if chained.confidence is not None else None
        output.draft_token_ids, output.draft_confidence = proposals(req_ids, chained.token_ids.tolist(), survival)
        output.draft_seconds = chained.seconds
        output.draft_rows = self.drafted_rows = len(req_ids)

    def propose(
        self,
        req_ids: list[str],
        sequences: Sequence[tuple[list[int], list[int], RequestSamplingState]],
        num_accepted: list[int],
        hidden: StepHiddenStates | None = None,
        draft_limit: int | None = None,
    ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """Drafts for the next step of the requests that may take them, and their survival
        estimates where the proposer gives them (``survival_row``: plain floats, one per
        draft); ``sequences[i]`` is request ``i``'s prompt, its output so far and its sampling
        state; ``hidden`` the step's states (``record_hidden_states``), for a proposer that
        reads them; ``draft_limit``: at most that many requests draft (the first), the others as
        after a step without drafts. Requests that may draft later (short of ``min_tokens``)
        hand their states to a proposer that ``keeps_context``."""
        live = self._live_rows(req_ids, sequences)
        rows = [i for i in live if may_speculate(sequences[i][2].params, len(sequences[i][1]))]
        if draft_limit is not None:
            rows = rows[:draft_limit]
        self.drafted_rows = len(rows)
        if self.proposer.keeps_context and len(rows) < len(live):
            waiting = sorted(set(live) - set(rows))
            self.proposer.keep_context(self._inputs(req_ids, sequences, num_accepted, waiting, hidden, copy=False))
        if not rows:
            return {}, {}
        inputs = self._inputs(req_ids, sequences, num_accepted, rows, hidden)
        drafts = self.proposer.propose(inputs)
        limit = self.config.num_speculative_tokens
        if drafts.probs is not None:
            for req_id, tokens, probs in zip(drafts.req_ids, drafts.token_ids, drafts.probs):
                self.draft_probs.store(req_id, tokens[:limit], None if probs is None else probs[:limit])
        return proposals(drafts.req_ids, [tokens[:limit] for tokens in drafts.token_ids], drafts.confidence)

    def keep_context(
        self,
        req_ids: list[str],
        sequences: Sequence[tuple[list[int], list[int], RequestSamplingState]],
        num_accepted: list[int],
        hidden: StepHiddenStates | None = None,
    ) -> None:
        """After a step without drafts: hand its states to a proposer that ``keeps_context``
        (arguments as ``propose``'s), for every request that may draft at some point; states
        are held a few steps (``HiddenStateCollector.hold``) and handed over together, or with
        the next proposal, whichever comes first."""
        if not self.proposer.keeps_context:
            return
        rows = self._live_rows(req_ids, sequences)
        if not rows:
            return
        if len(rows) == len(req_ids):  # most steps: every request, as they are
            held_ids, held_accepted = req_ids, num_accepted
        else:
            held_ids, held_accepted = [req_ids[i] for i in rows], [num_accepted[i] for i in rows]
        if hidden is not None and self.hidden.hold(hidden, held_ids, held_accepted):
            return  # handed over with a later step's (a few steps' states in one pass)
        self.proposer.keep_context(self._inputs(req_ids, sequences, num_accepted, rows, hidden, copy=False))

    def _live_rows(self, req_ids: list[str], sequences: Sequence[tuple[list[int], list[int], RequestSamplingState]]) -> list[int]:
        """The rows of requests the worker still runs and that may draft at some point.

        A request the worker dropped while its step was in flight (finished, preempted or
        aborted, heard with the next step) takes no part: its cache is gone and stays gone."""
        live, eligible, ineligible = self._live, self._eligible, self._ineligible
        if eligible.issuperset(req_ids) and (live is None or live.keys() >= set(req_ids)):
            return list(range(len(req_ids)))  # most steps: set operations, no loop over the batch
        rows = []
        for i, req_id in enumerate(req_ids):
            if (live is not None and req_id not in live) or req_id in ineligible:
                continue
            if req_id not in eligible:
                if not may_ever_speculate(sequences[i][2].params):
                    ineligible.add(req_id)
                    continue
                eligible.add(req_id)
            rows.append(i)
        return rows

    def _inputs(
        self,
        req_ids: list[str],
        sequences: Sequence[tuple[list[int], list[int], RequestSamplingState]],
        num_accepted: list[int],
        rows: list[int],
        hidden: StepHiddenStates | None,
        copy: bool = True,
    ) -> ProposerInputs:
        """The proposer's view of ``rows``: their sequences (``copy=False``: read-only views
        of prompt and output, no copy of either) and, for a proposer that reads them, the
        states of theirs not handed over yet."""
        joined = (lambda prompt, output: prompt + output) if copy else TokenSequence
        inputs = ProposerInputs(
            req_ids=[req_ids[i] for i in rows],
            token_ids=[joined(sequences[i][0], sequences[i][1]) for i in rows],
            num_accepted=[num_accepted[i] for i in rows],
            sampling=[sequences[i][2] for i in rows],
        )
        if hidden is not None:
            given = self.hidden.gather(hidden, inputs.req_ids, inputs.num_accepted)
            inputs.hidden_states, inputs.positions, inputs.num_hidden_states = given.states, given.positions, given.counts
        return inputs


def proposals(
    req_ids: list[str], token_rows: list[list[int]], confidence_rows: list[Any] | None
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """The drafts of each request that has some, and their survival estimates where the
    proposer gave a usable row (``survival_row``), as a step's output carries them."""
    proposed = {req_id: tokens for req_id, tokens in zip(req_ids, token_rows) if tokens}
    confidence: dict[str, list[float]] = {}
    if confidence_rows is not None:
        for req_id, row in zip(req_ids, confidence_rows):
            tokens = proposed.get(req_id)
            if tokens and row is not None:
                survival = survival_row(row, len(tokens))
                if survival is not None:
                    confidence[req_id] = survival
    return proposed, confidence


def survival_row(row: Any, num_drafts: int) -> list[float] | None:
    """A proposer's survival estimates for ``num_drafts`` drafts as the scheduler reads them:
    plain floats in [0, 1] (NaN as 0), non-increasing (each at most the one before), cut to
    the drafts; None where it has fewer values than drafts (the drafts then count as having
    no estimates)."""
    values = row.tolist() if hasattr(row, "tolist") else list(row)
    if len(values) < num_drafts:
        return None
    survival, low = [], 1.0
    for value in values[:num_drafts]:
        value = float(value)
        low = min(low, value if value > 0.0 else 0.0)  # NaN compares false: 0
        survival.append(low)
    return survival
