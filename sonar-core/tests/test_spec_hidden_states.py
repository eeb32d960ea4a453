"""The hidden-state collector over long random runs: every request's kept positions reach the
proposer exactly once, in order, with their own states, however steps are held, handed over
in parts, or dropped with their request."""

from __future__ import annotations

import random

import pytest
import torch

from sonar.sampler.metadata import RequestSamplingState
from sonar.sampling_params import SamplingParams
from sonar.spec_decode.hidden_states import HOLD_STEPS, HiddenStateCollector
from sonar.worker.block_table import BlockTable
from sonar.worker.input_batch import CachedRequestState, build_step_batch

BLOCK = 16


class Request:
    """A request as the test drives it: what it has computed, and which of its positions'
    states the collector still owes the proposer (position -> the state's value)."""

    def __init__(self, req_id: str, prompt_len: int, table: BlockTable) -> None:
        tokens = list(range(prompt_len))
        sampling = RequestSamplingState(params=SamplingParams(), prompt_token_ids=tokens, output_token_ids=[], generator=None, eos_token_ids=[])
        self.state = CachedRequestState(req_id=req_id, prompt_token_ids=tokens, num_computed_tokens=0, sampling=sampling)
        self.owed: dict[int, float] = {}
        table.add(req_id, list(range(64)))

    @property
    def prefilling(self) -> bool:
        return self.state.num_computed_tokens < len(self.state.prompt_token_ids)


def _plan(request: Request, rng: random.Random) -> tuple[int, int]:
    """This step's tokens for the request and the drafts among them."""
    left = len(request.state.prompt_token_ids) - request.state.num_computed_tokens
    if left > 0:
        return min(left, rng.randint(1, 12)), 0
    drafts = rng.choice([0, 0, 1, 3, 5])
    return 1 + drafts, drafts


@pytest.mark.parametrize("seed", range(6))
def test_every_kept_position_is_handed_over_once_in_order_with_its_own_state(seed):
    rng = random.Random(seed)
    table = BlockTable(64)
    collector = HiddenStateCollector()
    live: dict[str, Request] = {}
    next_id = 0
    handed: dict[str, list[int]] = {}
    for step_index in range(120):
        while len(live) < 6 and rng.random() < 0.7:  # arrivals
            req_id = f"r{next_id}"
            next_id += 1
            live[req_id] = Request(req_id, rng.randint(3, 40), table)
            handed[req_id] = []
        if not live:
            continue
        scheduled = [r for r in live.values() if rng.random() < 0.9] or [next(iter(live.values()))]
        plans = {r.state.req_id: _plan(r, rng) for r in scheduled}
        for r in scheduled:
            count, drafts = plans[r.state.req_id]
            r.state.draft_token_ids = [7] * drafts
        batch = build_step_batch([r.state for r in scheduled], [plans[r.state.req_id][0] for r in scheduled], table, BLOCK, torch.device("cpu"))
        values = step_index * 1000.0 + torch.arange(batch.positions.shape[0], dtype=torch.float32)
        step = collector.record(batch, values[:, None].repeat(1, 2))
        starts = batch.token_starts()
        sampled, accepted = [], []
        for row, state in enumerate(batch.states):
            request, count = live[state.req_id], batch.num_scheduled[row]
            drafts = plans[state.req_id][1]
            keep = count if row not in batch.sample_rows else count - drafts
            if row in batch.sample_rows:
                kept_drafts = rng.randint(0, drafts) if drafts else 0
                keep += kept_drafts
                sampled.append(state.req_id)
                accepted.append(kept_drafts + 1)
            for j in range(keep):  # the states the proposer is owed: positions computed from kept tokens
                request.owed[state.num_computed_tokens + j] = float(values[starts[row] + j])
            state.num_computed_tokens += keep
            if row in batch.sample_rows:  # its kept drafts and the token sampled after them
                state.sampling.output_token_ids[:] = [5] * (state.num_computed_tokens + 1 - len(state.prompt_token_ids))
        # hold, or hand over (sometimes in two parts, as a proposal that drafts for a few does)
        if sampled and not (rng.random() < 0.3 and collector.hold(step, sampled, accepted)):
            order = list(range(len(sampled)))
            rng.shuffle(order)
            cut = rng.randint(0, len(order))
            for part in (order[:cut], order[cut:]):
                if not part:
                    continue
                given = collector.gather(step, [sampled[i] for i in part], [accepted[i] for i in part])
                assert given.states.shape[0] == given.positions.shape[0] == sum(given.counts)
                at = 0
                for i, count in zip(part, given.counts):
                    request = live[sampled[i]]
                    positions = given.positions[at : at + count].tolist()
                    states = given.states[at : at + count, 0].tolist()
                    at += count
                    assert positions == sorted(request.owed), f"step {step_index}, {sampled[i]}"
                    assert states == [request.owed[p] for p in positions]
                    handed[sampled[i]] += positions
                    request.owed.clear()
        for req_id in [r for r in live if rng.random() < 0.05]:  # finished or preempted: its rows go nowhere
            collector.remove_requests({req_id})
            table.remove(req_id)
            del live[req_id]
    for positions in handed.values():
        assert positions == sorted(set(positions))  # once each, in order
    assert sum(len(p) for p in handed.values()) > 200


def test_a_hold_refuses_once_the_held_steps_are_full():
    table = BlockTable(64)
    request = Request("a", 1, table)
    collector = HiddenStateCollector()
    held = 0
    for step_index in range(HOLD_STEPS + 2):
        batch = build_step_batch([request.state], [1], table, BLOCK, torch.device("cpu"))
        step = collector.record(batch, torch.full((1, 2), float(step_index)))
        request.state.num_computed_tokens += 1
        request.state.sampling.output_token_ids.append(5)
        if not collector.hold(step, ["a"], [1]):
            given = collector.gather(step, ["a"], [1])
            assert given.counts == [held + 1] and given.states[:, 0].tolist() == [float(i) for i in range(held + 1)]
            break
        held += 1
    assert held == HOLD_STEPS - 1


def test_a_hand_over_for_no_request_is_empty():
    table = BlockTable(64)
    request = Request("a", 4, table)
    collector = HiddenStateCollector()
    batch = build_step_batch([request.state], [4], table, BLOCK, torch.device("cpu"))
    step = collector.record(batch, torch.ones(4, 2))
    given = collector.gather(step, [], [])
    assert given.counts == [] and given.states.shape == (0, 2) and given.positions.shape == (0,)
