"""The worker's view of the running requests and one step's flat token batch."""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field

import numpy as np
import torch

from sonar.attention import AttentionMetadata
from sonar.worker.block_table import BlockTable
from sonar.engine.request import token_at, token_ids_in
from sonar.sampler.metadata import RequestSamplingState
from sonar.tensors import to_device


@dataclass(slots=True, eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState  # holds params, generator and output_token_ids
    draft_token_ids: list[int] = field(default_factory=list)  # drafts this step verifies after its known tokens
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.sampling.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_ids_in(self.prompt_token_ids, self.sampling.output_token_ids, start, end)

    def token_at(self, index: int) -> int:
        return token_at(self.prompt_token_ids, self.sampling.output_token_ids, index)


@dataclass(slots=True)
class StepBatch:
    states: list[CachedRequestState]  # decodes first
    num_scheduled: list[int]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # indices into states of requests that produce a token this step
    logits_indices: torch.Tensor  # [len(sample_rows)] token index of each sampling request's last token
    # speculative decoding: each sample row's drafts (None: no row has any); a row with k
    # drafts has k + 1 logits_indices, its drafts' positions and its bonus position
    sample_drafts: list[list[int]] | None = None

    def token_starts(self) -> list[int]:
        """Each request's first token row: every layout puts a request's tokens together, in
        ``states`` order (the attention metadata's rows may differ: a verify step in a decode
        graph gives each token a row of its own)."""
        return list(itertools.accumulate(self.num_scheduled[:-1], initial=0)) if self.num_scheduled else []


def build_step_batch(
    states: list[CachedRequestState], num_scheduled: list[int], block_table: BlockTable, block_size: int, device: torch.device
) -> StepBatch:
    # decode first
    order = sorted(range(len(states)), key=lambda i: num_scheduled[i] != 1)
    states = [states[i] for i in order]
    num_scheduled = [num_scheduled[i] for i in order]
    num_decodes = sum(1 for n in num_scheduled if n == 1)

    token_ids: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    has_drafts = False
    for row, (state, n) in enumerate(zip(states, num_scheduled)):
        start = state.num_computed_tokens
        drafts = state.draft_token_ids
        if drafts:
            has_drafts = True
            token_ids.extend(state.token_ids(start, start + n - len(drafts)))
            token_ids.extend(drafts)
        else:
            token_ids.extend(state.token_ids(start, start + n))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if start + n == state.num_tokens + len(drafts):
            sample_rows.append(row)

    num_tokens = query_start_loc[-1]
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = np.diff(qsl)
    # positions: context_len .. seq_len-1 per sequence
    seq_of_token = np.repeat(np.arange(len(states)), q_lens)
    positions = np.arange(num_tokens) - qsl[:-1][seq_of_token] + (lens - q_lens)[seq_of_token]
    req_ids = [s.req_id for s in states]
    max_blocks = max((block_table.num_blocks_of[r] for r in req_ids), default=1)
    tables = block_table.gather(req_ids, max(max_blocks, 1))
    slot_mapping = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

    as_tensor = lambda a, dtype: to_device(a, device, dtype)
    metadata = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=as_tensor(qsl, torch.int32),
        seq_lens=as_tensor(lens, torch.int32),
        block_tables=as_tensor(tables, torch.int32),
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        max_query_len=int(q_lens.max()) if len(q_lens) else 0,
        max_seq_len=int(lens.max()) if len(lens) else 0,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    sample_drafts = None
    if has_drafts:
        sample_drafts = [states[row].draft_token_ids for row in sample_rows]
        ends = qsl[1:][sample_rows]
        indices = np.concatenate([np.arange(end - len(d) - 1, end) for end, d in zip(ends, sample_drafts)])
    else:
        indices = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, np.int64)
    logits_indices = as_tensor(indices, torch.int64)
    return StepBatch(
        states=states,
        num_scheduled=num_scheduled,
        input_ids=to_device(torch.tensor(token_ids, dtype=torch.int64), device),
        positions=as_tensor(positions, torch.int64),
        attn_metadata=metadata,
        sample_rows=sample_rows,
        logits_indices=logits_indices,
        sample_drafts=sample_drafts,
    )
