"""Several verify passes in one step (speculative decoding's ``verify_passes``) for a lone
greedy request whose proposer drafts from tokens alone: the passes after the first, run by
the host one after another, and the output of a step whose passes the device queued at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sonar.attention import ForwardContext
from sonar.engine.scheduler_output import ModelRunnerOutput
from sonar.sampler.metadata import RequestSamplingState
from sonar.spec_decode.worker_side import RequestSequences

if TYPE_CHECKING:
    from sonar.worker.input_batch import StepBatch
    from sonar.worker.model_runner import LaunchedStep


def pass_stop_ids(sampling: RequestSamplingState) -> set[int]:
    """The tokens that end a request's verify passes: its stop token ids, and its eos ids
    unless it ignores them."""
    stops = set(sampling.params.stop_token_ids or ())
    if not sampling.params.ignore_eos:
        stops.update(sampling.eos_token_ids or ())
    return stops


class VerifyPasses:
    """The model runner's verify passes beyond a step's first (a mixin of ``ModelRunner``)."""

    def _may_run_passes(self, step: LaunchedStep, batch: StepBatch) -> bool:
        """Whether a launched verify step may go on with further passes (the scheduler gave
        it rows for them): one greedy request, verified without logprobs, on one worker
        holding the whole model, no KV connector; a proposer that drafts from the tokens
        alone, or one that drafts in passes whose next drafts are chained behind this one."""
        proposer = self.spec.proposer
        if proposer.drafts_between_passes:
            drafts = step.chained is None
        else:
            drafts = proposer.drafts_in_passes and step.chained is not None and step.chained.on_device is not None
        return (
            drafts
            and len(batch.states) == 1
            and step.logprobs is None
            and step.early_tokens is None
            and batch.states[0].sampling.params.greedy
            and self.stage.is_single
            and self.kv_connector is None
        )

    def _further_passes(self, step: LaunchedStep, batch: StepBatch, rows: int) -> StepBatch:
        """Run up to ``verify_passes`` verify passes of a lone request within this step.

        Before each further pass the host reads back the pass before's tokens, drafts from
        them and verifies those drafts from the position after the tokens it kept, within the
        ``rows`` the scheduler gave beyond the first pass; a proposer that drafts in passes
        has its drafts chained behind each pass, settled once the host read the pass. The
        last pass stays queued as the step's verification, read back by ``fetch``; the tokens
        of the ones before go into ``step.early_tokens``. A pass that emits a stop token,
        reaches ``max_tokens`` or leaves no rows is the last (it was read already: its tokens
        go back out of the output, so ``fetch`` takes them as any last pass's). Returns the
        last pass's batch."""
        state = batch.states[0]
        sampling = state.sampling
        outputs, params = sampling.output_token_ids, sampling.params
        stops = pass_stop_ids(sampling)
        position = state.num_computed_tokens  # the first row of the pass in flight
        end = position + batch.num_scheduled[0] + rows  # past the positions reserved for the step
        drafts, early = step.verified.layout.drafts[0], []
        for _ in range(self.spec.config.verify_passes - 1):
            token_ids = step.verified.result.token_ids.tolist()  # waits for the pass in flight
            kept = step.verified.layout.leading_matches(token_ids)[0]
            chained = step.chained
            emitted = token_ids[: kept + 1]
            outputs.extend(emitted)
            room = end - (position + kept + 1)  # rows left for a next pass (its known token, its drafts)
            if room < 1 or stops.intersection(emitted) or (params.max_tokens is not None and len(outputs) >= params.max_tokens):
                del outputs[len(outputs) - len(emitted) :]  # this pass is the last: fetch reads it
                break
            step.passes.append([len(drafts), kept])
            early += emitted
            position += kept + 1
            if chained is not None:  # drafted behind the pass: its context settled on what it kept
                self.spec.proposer.settle_chained(chained.req_ids, [kept])
                drafts = chained.on_device[0].tolist()[: room - 1]
            else:
                proposed, _ = self.spec.propose([state.req_id], RequestSequences([state]), [kept + 1])
                drafts = proposed.get(state.req_id, [])[: room - 1]
            state.num_computed_tokens, state.draft_token_ids = position, drafts
            batch = self.build_batch([state], [1 + len(drafts)])
            state.draft_token_ids = []
            self._prepare_forward(batch)
            hidden = self.model(batch.input_ids, batch.positions, ForwardContext(batch.attn_metadata, self.kv_caches))
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            step.verified = self.spec.verify(self.sampler, logits, [sampling], [drafts])
            if chained is not None:
                step.hidden = self.spec.record_hidden_states(batch, hidden)
                step.chained = self.spec.chain(step.verified, step.hidden, [state.req_id], [state], 1, None)
            step.sampled = step.verified.result.token_ids.to("cpu", non_blocking=True)
            accepted = step.verified.result.num_accepted  # this pass's (chaining counts them on the device), not the first's
            step.num_accepted = None if accepted is None else accepted.to("cpu", non_blocking=True)
            if chained is not None and step.chained is None:  # nothing drafted behind this pass: the last
                break
        if early:
            step.early_tokens = early
        if step.chained is not None:
            step.chained.num_earlier = len(early)
        return batch

    def _resolve_device_passes(self, step: LaunchedStep) -> None:
        """A step whose passes were queued on the device at once (its one request): every
        token they emitted in place of its placeholder, each pass's counts for the metrics;
        the request has computed the positions of all but the last token."""
        passes = step.device_passes
        tokens, counts = passes.read()
        outputs, index = step.placeholders[0]
        outputs[index : index + 1] = tokens
        step.sample_states[0].num_computed_tokens = passes.start + len(tokens)
        req_id = step.req_ids[0]
        step.output = ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=[tokens[0]], logprobs=[None], prompt_logprobs=step.prompt_logprobs,
            verified_token_ids={req_id: tokens}, verified_passes={req_id: counts},
        )
